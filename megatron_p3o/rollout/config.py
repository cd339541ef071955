"""The rollout stage's configuration (``rollout:`` in a recipe) and this rank's share of it.

Why here: the component that reads a setting owns its dataclass; ``config.TrainConfig`` only
nests it. The scheduler and the backends take these objects as they are, with no twin struct.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Dict, List, Literal, Optional

from megatron_p3o.env.config import MultiTurnConfig
from megatron_p3o.rollout.sglang import SGLangConfig
from megatron_p3o.runtime.errors import ConfigError
from megatron_p3o.runtime.fields import check_ranges
from megatron_p3o.types import SamplingParams


@dataclass(frozen=True)
class RolloutConfig:
    """Attributes:
    engine: "embedded" (transformers, in-process) or "sglang".
    device: where the embedded engine runs: "auto" (the trainer's GPU when there is one),
        "cpu" or "cuda".
    precision: embedded engine precision (fp32, bf16, fp16, fp8, fp8_block, fp8_w8a8; see
        :mod:`.embedded` for what each FP8 simulation rounds).
    fp8_kv_cache: embedded engine with an fp8 precision: also round K/V to e4m3.
    embedded_max_batch: rows the embedded engine generates in one batch (its KV cache holds
        them all; the tiny recipe's 256 completions are one batch, one forward per new token).
    n_samples: completions per prompt (the GRPO group size G).
    sampling: sampling parameters (``stop_token_ids`` gets the tokenizer's EOS added; ``seed``
        is set per batch by the scheduler).
    sync_every: push weights to the engine every L optimizer steps (OAPL's L).
    max_staleness: asynchronous rollouts may lag the trainer by at most K versions (0: sync).
    dynamic_sampling: DAPO dynamic sampling — refill groups whose rewards are all equal with
        fresh prompts, up to ``dynamic_max_rounds`` rounds per batch.
    logprob_noise: stress tests only — σ of Gaussian noise added to the *reported* behaviour
        log-probs after sampling (misreported ℓb; not a distribution: E_b[ρ] = e^{σ²/2}).
    logit_noise: stress tests only (embedded engine) — σ of Gaussian noise added to the engine's
        logits before sampling; ℓb are the exact log-probs of that perturbed distribution.
    weight_rounding_step: stress tests only (embedded engine) — a persistent error in the
        engine's copy of the weights: every linear weight rounded, per output channel, to the
        nearest multiple of ``step · max|w_row|`` at every push (1/7: 4-bit symmetric
        weight-only quantization, 1/3: 3-bit; 0: off), so the same weights give the same error
        every step. ℓb stay exact for that engine; the mismatch is structured, unlike
        ``logit_noise``'s fresh draws.
    engine_temperature: stress tests only — let the engine sample at another temperature
        than the trainer's ``sampling.temperature`` (None: the same, as it must be).
    deterministic: a zero-mismatch control on GPUs: SGLang's deterministic inference
        (``--enable-deterministic-inference``) and the trainer's deterministic algorithms
        (``torch.use_deterministic_algorithms``, ``CUBLAS_WORKSPACE_CONFIG``). GPU-unverified.
        On CPU the control is ``precision: fp32`` with the embedded engine.
    sglang: the SGLang server/router (``engine: sglang``): attach with ``url``, or launch.
    weight_sync: how weights reach SGLang — "distributed" (update_weights_from_distributed
        over a process group, backend ``sglang.sync_backend``: nccl on GPUs, gloo for CPU
        servers), "tensor" (update_weights_from_tensor from rank 0: data for CPU servers),
        "colocated" (CUDA IPC from every trainer rank, same GPUs) or "disk" (a safetensors
        directory every server reads; a relaunched server reloads it).
    weight_sync_dir: shared directory for the "disk" mode.
    weight_sync_port: TCP port on trainer rank 0 for the "distributed" weight-update rendezvous
        (one group for every server).
    sglang_workers: URLs of the SGLang servers behind ``sglang.url`` when it is a router;
        weights are pushed to each of them (empty: ``sglang.url`` is the one server).
    routing_replay: mixture-of-experts models: "r3" makes the trainer's forwards (ℓold
        recompute, ESS pre-pass, gradient pass) use the experts the engine chose for each token
        (rollout routing replay); "off" lets the trainer route by itself. Both report the
        per-layer route agreement between engine and trainer.
    multi_turn: multi-turn, tool-using rollouts against an environment
        (:class:`~megatron_p3o.env.config.MultiTurnConfig`, ``docs/multiturn.md``); None: one
        completion per sample.
    """

    engine: Literal["embedded", "sglang"] = "embedded"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    precision: Literal["fp32", "bf16", "fp16", "fp8", "fp8_block", "fp8_w8a8"] = "bf16"
    fp8_kv_cache: bool = False
    embedded_max_batch: int = 256
    n_samples: int = 8
    sampling: SamplingParams = field(default_factory=SamplingParams)
    sync_every: int = 1
    max_staleness: int = 0
    dynamic_sampling: bool = False
    dynamic_max_rounds: int = 3
    logprob_noise: float = 0.0
    logit_noise: float = 0.0
    weight_rounding_step: float = 0.0
    engine_temperature: Optional[float] = None
    deterministic: bool = False
    sglang: SGLangConfig = field(default_factory=SGLangConfig)
    weight_sync: Literal["distributed", "tensor", "colocated", "disk"] = "distributed"
    weight_sync_dir: str = ""
    weight_sync_port: int = 29650
    sglang_workers: List[str] = field(default_factory=list)
    routing_replay: Literal["off", "r3"] = "off"
    multi_turn: Optional[MultiTurnConfig] = None

    RANGES: ClassVar[Dict[str, str]] = {
        "embedded_max_batch": ">= 1",
        "n_samples": ">= 1",
        "sync_every": ">= 1",
        "max_staleness": ">= 0",
        "dynamic_max_rounds": ">= 0",
        "logprob_noise": ">= 0",
        "logit_noise": ">= 0",
        "weight_rounding_step": "in [0, 1]",
        "engine_temperature": "> 0",
        "weight_sync_port": "a port in [1, 65535]",
    }

    def __post_init__(self):
        check_ranges(self, self.RANGES, "rollout")
        if self.weight_sync == "disk" and self.engine == "sglang" and not self.weight_sync_dir:
            raise ConfigError(
                "rollout.weight_sync=disk needs rollout.weight_sync_dir (a directory every "
                "node and the SGLang servers can read)"
            )
        if self.fp8_kv_cache and not self.precision.startswith("fp8"):
            raise ConfigError(
                f"rollout.fp8_kv_cache needs an fp8 rollout.precision, got {self.precision!r}"
            )
        if self.weight_rounding_step and self.engine != "embedded":
            raise ConfigError(
                "rollout.weight_rounding_step rounds the embedded engine's copy of the weights; "
                "SGLang has no such knob (use rollout.engine=embedded)"
            )
        if self.logit_noise and self.engine != "embedded":
            raise ConfigError(
                "rollout.logit_noise perturbs the embedded engine's logits; SGLang has no such "
                "knob (use rollout.engine=embedded)"
            )


@dataclass(frozen=True)
class RolloutShard:
    """What one DP rank rolls out: derived at launch from the recipe and the layout.

    Attributes:
        prompts: prompts per rollout batch on this DP rank.
        sampling: the engine's sampling parameters (EOS added; the stress knob
            ``engine_temperature`` applied).
        seed: run seed; dp_rank: this rank (sampling seeds differ per DP rank).
        end: the first batch index not to produce (the run's last step); None = no end. An
            async producer stops there, so nothing is generated that no step trains on, and
            ranks sharing a server stop after the same batch.
    """

    prompts: int
    sampling: SamplingParams
    seed: int = 0
    dp_rank: int = 0
    end: Optional[int] = None
