"""An embedded rollout engine: a transformers causal LM on the CPU, in a chosen precision.

Why: where no GPU (and so no SGLang) exists, the trainer still needs an engine that samples in
*another* precision than the fp32 trainer, so the train–rollout mismatch P3O corrects is real.
Precisions: fp32, bf16, fp16, and FP8 simulated on CPU by rounding through
``torch.float8_e4m3fn`` while computing in bf16:

- ``fp8``: linear weights with one scale per tensor;
- ``fp8_block``: linear weights with 128×128 block scales (FP8 checkpoints, DeepSeek-V3 style);
- ``fp8_w8a8``: ``fp8_block`` weights plus the linear layers' input activations rounded per
  token and 128-channel group (dynamic scales), as block-FP8 GEMMs (SGLang's w8a8) see them;
- ``fp8_kv_cache`` (with any fp8 precision): K and V rounded to e4m3 with scale 1.0 (SGLang's
  FP8 KV cache without calibrated scales), applied at the k/v projections' outputs.

Not simulated: the FP8 GEMM's own accumulation order and output rounding, the attention kernel,
the lm_head and embeddings (kept in bf16, as FP8 checkpoints do), and K's rounding after RoPE
(here before it: RoPE is a rotation, so magnitudes and the rounding error are alike).

Sampling is batched with a KV cache; each token's log-prob is taken under exactly the
distribution it was drawn from (softmax(logits / T), truncated by top-k / top-p when enabled).
As serving engines do, the n samples of a prompt share one prefill (its KV rows copied to each),
and rows that finished leave the later forwards (in powers of two, so few shapes); neither
changes a draw (the sampler still draws for every row) or a row's forward (its own computation:
bit for bit on this CPU, recipe runs compared; a GPU's GEMMs may round a row differently at
another batch size, as any engine's batching does), tested against a plain loop over the whole
batch.

R2PO's residual rollout head (``rollout_head=True``): the engine samples from
softmax((W_lm·h + W₂·ReLU(W₁·h)) / T), h the final normalized hidden state (a hook on
``lm_head``); ``rollout_head.w1.weight`` / ``rollout_head.w2.weight`` arrive with the other
weights, and :meth:`EmbeddedEngine.base_head` switches the residual off (evaluation).

Mixture-of-experts models: the engine records, for every token it feeds through the model
(prompt and completion, all but the last token), the top-k experts each layer's router chose
(``Sample.routed_experts [tokens, layers, k]``, uint8/int16), for the trainer's routing replay
and its route-agreement metric.

Stress knob ``logit_noise`` (σ): every sampling step draws ε ~ N(0, σ²) per vocabulary entry and
samples from softmax((z + ε) / T), reporting the exact log-probs of that perturbed distribution:
a precision-like train–rollout mismatch with honest ℓb (unlike corrupting the reported ℓb).
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from typing import Dict, Iterable, List, Optional, Sequence

import torch
from torch import Tensor

from megatron_p3o.model.hf.mapping import parse_moe_hf_name
from megatron_p3o.rollout.engine import Bucket, RolloutEngine
from megatron_p3o.rollout.sampling import sampling_logprobs
from megatron_p3o.types import Sample, SamplingParams
from megatron_p3o.weight_sync.fp8 import FP8_LINEARS as _FP8_LINEARS
from megatron_p3o.weight_sync.fp8 import FP8_MAX, quant_dequant_block

PRECISIONS = {
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp8": torch.bfloat16,
    "fp8_block": torch.bfloat16,
    "fp8_w8a8": torch.bfloat16,
}


def fp8_quant_dequant(w: Tensor, block: Optional[int] = None) -> Tensor:
    """``w`` rounded through float8_e4m3fn: one scale per tensor, or per ``block × block`` tile
    (:func:`megatron_p3o.weight_sync.fp8.quantize_block`, the quantizer of FP8 pushes)."""
    if block is not None:
        return quant_dequant_block(w, block)
    w32 = w.float()
    scale = w32.abs().max().clamp_min(1e-12) / FP8_MAX
    return ((w32 / scale).to(torch.float8_e4m3fn).float() * scale).to(w.dtype)


def channel_round(w: Tensor, step: float) -> Tensor:
    """``w [out, in]`` rounded per output channel to the nearest multiple of
    ``step · max_j |w_rj|`` (k-bit symmetric integers are step = 1 / (2^(k−1) − 1); a row of
    zeros stays zero). Computed in float32, returned in ``w``'s dtype. The stress knob
    ``rollout.weight_rounding_step``: a weight-only quantized engine."""
    x = w.float()
    scale = x.abs().amax(dim=1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny) * step
    return (torch.round(x / scale) * scale).to(w.dtype)


def fp8_activation_quant(x: Tensor, group: int = 128) -> Tensor:
    """``x [..., d]`` rounded through e4m3 with one dynamic scale per token and ``group``
    channels (the activation side of block-FP8 GEMMs)."""
    d = x.shape[-1]
    pad = -d % group
    xf = torch.nn.functional.pad(x.float(), (0, pad))
    g = xf.reshape(*xf.shape[:-1], -1, group)
    scale = g.abs().amax(-1, keepdim=True).clamp_min(1e-12) / FP8_MAX
    q = (g / scale).to(torch.float8_e4m3fn).float() * scale
    return q.reshape(*xf.shape)[..., :d].to(x.dtype)


def fp8_kv_round(x: Tensor) -> Tensor:
    """K/V values stored as e4m3 with scale 1.0 (clamped to ±448)."""
    return x.float().clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float().to(x.dtype)


class EmbeddedEngine(RolloutEngine):
    """transformers model held in ``precision``; weights come from ``update_weights``."""

    name = "embedded"

    def __init__(
        self,
        hf_config: dict,
        precision: str = "bf16",
        max_batch: int = 64,
        pad_token_id: int = 0,
        device: str = "cpu",
        logit_noise: float = 0.0,
        fp8_kv_cache: bool = False,
        rollout_head: bool = False,
        weight_rounding_step: float = 0.0,
    ):
        from transformers import AutoConfig, AutoModelForCausalLM

        if precision not in PRECISIONS:
            raise ValueError(f"rollout.precision={precision!r}; choose one of {sorted(PRECISIONS)}")
        self.precision, self.dtype = precision, PRECISIONS[precision]
        cfg = dict(hf_config)
        cfg = AutoConfig.for_model(
            cfg.pop("model_type"),
            **{k: v for k, v in cfg.items() if k not in ("architectures", "torch_dtype")},
        )
        self.device = torch.device(device)  # the trainer's GPU on a GPU machine
        with self.device:
            self.model = AutoModelForCausalLM.from_config(cfg, dtype=self.dtype).eval()
        self.tied = bool(getattr(cfg, "tie_word_embeddings", False))
        if fp8_kv_cache and not precision.startswith("fp8"):
            raise ValueError("rollout.fp8_kv_cache needs an fp8 rollout.precision")
        self._fp8_hooks(precision == "fp8_w8a8", fp8_kv_cache)
        self.head_on = rollout_head
        if rollout_head:
            self._add_rollout_head(cfg)
        self._routes: Optional[List] = None  # per MoE layer: the last call's expert indices
        self._route_hooks()
        self.params: Dict[str, torch.nn.Parameter] = dict(self.model.named_parameters())
        self.max_batch, self.pad_token_id = max_batch, pad_token_id
        if logit_noise < 0:
            raise ValueError(f"rollout.logit_noise={logit_noise} must be >= 0")
        self.logit_noise = float(logit_noise)
        if not 0 <= weight_rounding_step <= 1:
            raise ValueError(f"rollout.weight_rounding_step={weight_rounding_step}: in [0, 1]")
        self.rounding_step = float(weight_rounding_step)
        self.weight_version = -1  # no weights loaded yet
        # transformers >= 5 calls the KV cache ``cache``; earlier versions ``past_key_values``
        import inspect

        self._cache_kw = (
            "cache"
            if "cache" in inspect.signature(self.model.forward).parameters
            else "past_key_values"
        )

    def _fp8_hooks(self, activations: bool, kv: bool) -> None:
        for name, mod in self.model.named_modules():
            leaf = name.rsplit(".", 1)[-1]
            if leaf not in _FP8_LINEARS:
                continue
            if activations:
                mod.register_forward_pre_hook(lambda m, a: (fp8_activation_quant(a[0]),))
            if kv and leaf in ("k_proj", "v_proj"):
                mod.register_forward_hook(lambda m, a, out: fp8_kv_round(out))

    def _add_rollout_head(self, cfg) -> None:
        """W₁ (d×d), W₂ (V×d) as ``rollout_head.w1/w2`` and a hook adding W₂·ReLU(W₁·h) to the
        lm_head's logits while ``head_on``."""
        d, v = cfg.hidden_size, cfg.vocab_size
        head = torch.nn.Module()
        with self.device:
            head.w1 = torch.nn.Linear(d, d, bias=False, dtype=self.dtype)
            head.w2 = torch.nn.Linear(d, v, bias=False, dtype=self.dtype)
        torch.nn.init.zeros_(head.w1.weight)
        torch.nn.init.zeros_(head.w2.weight)
        self.model.rollout_head = head

        def add(module, args, out):
            if not self.head_on:
                return out
            h = args[0]
            return out + head.w2(torch.relu(head.w1(h))).to(out.dtype)

        self.model.get_output_embeddings().register_forward_hook(add)

    def _route_hooks(self) -> None:
        """A hook on every MoE router (transformers' ``mlp.gate`` returns logits, scores and the
        top-k indices): the indices of each model call, per layer."""
        layers = getattr(getattr(self.model, "model", None), "layers", [])
        gates = [getattr(getattr(layer, "mlp", None), "gate", None) for layer in layers]
        if not any(g is not None and hasattr(g, "top_k") for g in gates):
            return
        c = self.model.config
        n_experts = int(getattr(c, "num_experts", None) or getattr(c, "num_local_experts", 0))
        self._route_dtype = torch.uint8 if n_experts < 256 else torch.int16
        self._routes = [None] * len(gates)
        for i, g in enumerate(gates):

            def keep(module, args, out, i=i):
                self._routes[i] = out[2].detach()

            g.register_forward_hook(keep)

    def _call_routes(self, b: int) -> Optional[Tensor]:
        """``[b, s, layers, k]`` expert indices of the last model call (None without MoE)."""
        if self._routes is None:
            return None
        r = torch.stack(self._routes, 1)  # [b·s, layers, k]
        return r.reshape(b, -1, r.shape[1], r.shape[2]).to(self._route_dtype).cpu()

    @contextmanager
    def base_head(self):
        """Sample from the base head only inside the block (evaluation of the policy)."""
        on, self.head_on = self.head_on, False
        try:
            yield
        finally:
            self.head_on = on

    # -- weights ------------------------------------------------------------------------------
    def _to_engine(self, name: str, t: Tensor) -> Tensor:
        linear = t.dim() == 2 and name.rsplit(".", 2)[-2] in _FP8_LINEARS
        if self.rounding_step and linear:  # before the engine's dtype: the knob's own error
            t = channel_round(t, self.rounding_step)
        t = t.to(self.dtype)
        if (
            self.precision.startswith("fp8")
            and t.dim() == 2
            and name.rsplit(".", 2)[-2] in _FP8_LINEARS
        ):
            t = fp8_quant_dequant(t, None if self.precision == "fp8" else 128)
        return t

    def _target(self, name: str):
        """``(parameter name, index into it)`` of an HF tensor: itself, or (MoE checkpoint
        names, :data:`~megatron_p3o.model.hf.mapping.MOE_HF_NAMES`) the router, or one routed
        expert's
        slice of transformers' fused ``experts.gate_up_proj [E, 2·I, h]`` (gate rows first) /
        ``experts.down_proj [E, h, I]``."""
        moe = parse_moe_hf_name(name)
        if moe is None:
            return name, ()
        layer, e, role = moe
        base = f"model.layers.{layer}.mlp."
        if role == "router":
            return base + "gate.weight", ()
        if role == "down":
            return base + "experts.down_proj", (e,)
        n = self.params[base + "experts.gate_up_proj"].shape[1] // 2
        rows = slice(0, n) if role == "gate" else slice(n, 2 * n)
        return base + "experts.gate_up_proj", (e, rows)

    def update_weights(self, buckets: Iterable[Bucket], version: int) -> None:
        seen = set()
        slices: Dict[str, int] = {}  # fused expert parameters: slices written
        with torch.no_grad():
            for bucket in buckets:
                for name, tensor in bucket:
                    target, index = self._target(name)
                    p = self.params.get(target)
                    if p is None:
                        raise KeyError(f"update_weights: engine has no tensor {name!r}")
                    dst = p[index] if index else p
                    if tuple(dst.shape) != tuple(tensor.shape):
                        raise ValueError(
                            f"update_weights: {name}: shape {tuple(tensor.shape)}, engine "
                            f"expects {tuple(dst.shape)}"
                        )
                    dst.copy_(self._to_engine(name, tensor))
                    if index:
                        slices[target] = slices.get(target, 0) + 1
                    else:
                        seen.add(target)
        for target, n in slices.items():  # every expert's slices arrived
            p = self.params[target]
            if n == p.shape[0] * (2 if target.endswith("gate_up_proj") else 1):
                seen.add(target)
        expected = set(self.params) - ({"lm_head.weight"} if self.tied else set())
        missing = sorted(expected - seen)
        if missing:
            raise ValueError(
                f"update_weights: {len(missing)} tensors were not sent, e.g. {missing[:3]}"
            )
        self.weight_version = version

    def health(self) -> dict:
        return {"ok": True, "weight_version": self.weight_version, "precision": self.precision}

    # -- sampling -----------------------------------------------------------------------------
    def _left_pad(self, seqs: Sequence[Sequence[int]]):
        L = max(len(s) for s in seqs)
        # rows as Python lists, one tensor each (two slice writes per row were ~3 ms of a tiny
        # CPU rollout of 256 prompts)
        ids = torch.tensor([[self.pad_token_id] * (L - len(s)) + list(s) for s in seqs],
                           dtype=torch.long).reshape(len(seqs), L)  # fmt: skip
        mask = torch.tensor([[0] * (L - len(s)) + [1] * len(s) for s in seqs],
                            dtype=torch.long).reshape(len(seqs), L)  # fmt: skip
        pos = (mask.cumsum(-1) - 1).clamp_min(0)
        return ids.to(self.device), mask.to(self.device), pos.to(self.device)

    @torch.no_grad()
    def _sample_batch(
        self, prompts: List[List[int]], sampling: SamplingParams, gen: Optional[torch.Generator]
    ):
        ids, mask, pos = self._left_pad(prompts)
        b = len(prompts)
        # one prefill per distinct prompt (the n samples of a group share it, as SGLang's
        # prefix cache does): the rows keep the batch's padded length, so each is the same
        # computation as in the whole batch; the KV cache and logits are then indexed out
        first, rows = shared_prompts(prompts)
        shared = len(first) < b
        if shared:
            sel = torch.tensor(first, dtype=torch.long, device=self.device)
            idx = torch.tensor(rows, dtype=torch.long, device=self.device)
            ids_p, mask_p, pos_p = ids[sel], mask[sel], pos[sel]
        else:
            ids_p, mask_p, pos_p = ids, mask, pos
        out = self.model(input_ids=ids_p, attention_mask=mask_p, position_ids=pos_p,
                         use_cache=True)  # fmt: skip
        pre = self._call_routes(len(first))  # prompt tokens' experts (left-padded rows)
        cache, logits = out[self._cache_kw], out.logits[:, -1]
        if shared:
            cache.batch_select_indices(idx)
            logits = logits[idx]
            pre = pre[idx] if pre is not None else None
        L0 = ids.shape[1]
        routes: List[List[Tensor]] = [
            [pre[i, L0 - len(p) :]] if pre is not None else [] for i, p in enumerate(prompts)
        ]
        # Tokens, log-probs and "still generating" flags stay tensors until the end: one host
        # transfer per batch instead of per token and row (that loop was most of a CPU rollout).
        tok_steps: List[Tensor] = []
        lp_steps: List[Tensor] = []
        live_steps: List[Tensor] = []
        done = torch.zeros(b, dtype=torch.bool, device=self.device)
        next_pos = pos[:, -1] + 1
        stop_ids = torch.tensor(
            sorted(set(sampling.stop_token_ids)), dtype=torch.long, device=self.device
        )
        held = None  # the batch rows the model (and its KV cache) still runs; None: all b
        for step in range(sampling.max_new_tokens):
            if self.logit_noise > 0:  # the engine's own distribution is the perturbed one
                eps = torch.randn(logits.shape, generator=gen, device=self.device)
                logits = logits.float() + self.logit_noise * eps
            logp = sampling_logprobs(logits, sampling)
            tok = torch.multinomial(logp.exp(), 1, generator=gen)[:, 0]
            tok_steps.append(tok)
            lp_steps.append(logp.gather(-1, tok[:, None])[:, 0])
            live_steps.append(~done)  # rows already stopped do not record this token
            if len(stop_ids):
                done = done | torch.isin(tok, stop_ids)
            if step == sampling.max_new_tokens - 1 or bool(done.all()):
                break
            mask = torch.cat([mask, torch.ones(b, 1, dtype=mask.dtype, device=self.device)], 1)
            # finished rows leave the batch (their KV rows too) when the live ones fit in half
            # of it: rows in powers of two, few shapes for the kernels to be built for. Each
            # row's forward is its own computation, and the sampler still draws for all b rows
            # (``multinomial`` takes one exponential per entry whatever the values), so the
            # live rows' draws stay the same
            stopped = done.tolist()
            held = self._shrink(held, stopped, cache)
            rows = slice(None) if held is None else held
            feed = torch.where(done, torch.full_like(tok, self.pad_token_id), tok)
            out = self.model(
                input_ids=feed[rows, None],
                attention_mask=mask[rows],
                position_ids=next_pos[rows, None],
                use_cache=True,
                **{self._cache_kw: cache},
            )
            next_pos = next_pos + 1
            cache, new = out[self._cache_kw], out.logits[:, -1]
            # rows that left keep their last logits: sampled from, never recorded
            logits = new if held is None else logits.to(new.dtype).index_put_((held,), new)
            fed = self._call_routes(len(new))
            if fed is not None:
                ran = range(b) if held is None else held.tolist()
                for j, i in enumerate(ran):
                    if not stopped[i]:  # its newest token went through
                        routes[i].append(fed[j])
        counts = torch.stack(live_steps, 1).sum(1).tolist()
        all_toks = torch.stack(tok_steps, 1).tolist()
        all_lps = torch.stack(lp_steps, 1).tolist()
        toks = [row[:c] for row, c in zip(all_toks, counts)]
        lps = [row[:c] for row, c in zip(all_lps, counts)]
        finish = ["stop" if d else "length" for d in done.tolist()]
        routed = [torch.cat(r) if r else None for r in routes]
        return toks, lps, finish, routed

    def _shrink(self, held: Optional[Tensor], stopped: List[bool], cache) -> Optional[Tensor]:
        """The rows to run next (None: all of them): the held rows, cut to the smallest power
        of two that holds every live row (finished rows fill the rest) when that is fewer; the
        KV cache is cut to match."""
        ran = list(range(len(stopped))) if held is None else held.tolist()
        live = [r for r in ran if not stopped[r]]
        size = 1 << max(len(live) - 1, 0).bit_length()
        if size >= len(ran):
            return held
        live_set = set(live)
        rows = sorted(live + [r for r in ran if r not in live_set][: size - len(live)])
        where = {r: j for j, r in enumerate(ran)}
        dev = self.device
        cache.batch_select_indices(torch.tensor([where[r] for r in rows], device=dev))
        return torch.tensor(rows, dtype=torch.long, device=dev)

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        n: int,
        sampling: SamplingParams,
        keys: Optional[Sequence[str]] = None,  # one engine: nothing to route
    ) -> List[Sample]:
        if n < 1:
            raise ValueError(f"generate: n={n} must be >= 1")
        if self.weight_version < 0:
            raise RuntimeError("generate: no weights loaded (call update_weights first)")
        gen = None
        if sampling.seed is not None:
            gen = torch.Generator(device=self.device).manual_seed(sampling.seed)
        flat = [(g, list(p)) for g, p in enumerate(prompts) for _ in range(n)]
        samples: List[Sample] = []
        for s in range(0, len(flat), self.max_batch):
            part = flat[s : s + self.max_batch]
            toks, lps, fin, routed = self._sample_batch([p for _, p in part], sampling, gen)
            for (g, p), t, lp, f, r in zip(part, toks, lps, fin, routed):
                samples.append(
                    Sample(
                        prompt_ids=p,
                        completion_ids=t,
                        logprobs=lp,
                        finish_reason=f,
                        weight_version=self.weight_version,
                        group_id=g,
                        routed_experts=r,
                    )
                )
        return samples

    def turn_server(self, slots: int, max_len: int):
        """Multi-turn: every trajectory keeps its KV cache between turns, one forward per tick
        for all of them (:mod:`megatron_p3o.rollout.embedded_turns`)."""
        from megatron_p3o.rollout.embedded_turns import SlotTurnServer

        if self.weight_version < 0:
            raise RuntimeError("turn_server: no weights loaded (call update_weights first)")
        return SlotTurnServer(self, slots, max_len)

    @torch.no_grad()
    def score(
        self,
        prompts: Sequence[Sequence[int]],
        completions: Sequence[Sequence[int]],
        sampling: SamplingParams,
    ) -> List[List[float]]:
        """Teacher-forced log-probs of ``completions`` (one full forward, same distribution)."""
        seqs = [list(p) + list(c) for p, c in zip(prompts, completions)]
        ids, mask, pos = self._left_pad(seqs)
        logits = self.model(input_ids=ids, attention_mask=mask, position_ids=pos).logits
        L = ids.shape[1]
        out = []
        for i, c in enumerate(completions):
            if not c:
                out.append([])
                continue
            rows = logits[i, L - len(c) - 1 : L - 1]
            logp = sampling_logprobs(rows, sampling)
            out.append(logp.gather(-1, torch.as_tensor(list(c))[:, None])[:, 0].tolist())
        return out


def shared_prompts(prompts: Sequence[Sequence[int]]):
    """``(first, rows)``: the batch row where each distinct prompt first appears, and for every
    row the index of its prompt in ``first`` (the n samples of a group share one prefill)."""
    where: Dict[tuple, int] = {}
    first: List[int] = []
    rows: List[int] = []
    for i, p in enumerate(prompts):
        key = tuple(p)
        j = where.get(key)
        if j is None:
            j = where[key] = len(first)
            first.append(i)
        rows.append(j)
    return first, rows


def max_abs_diff(a: Sequence[Sequence[float]], b: Sequence[Sequence[float]]) -> float:
    return (
        max((abs(x - y) for ra, rb in zip(a, b) for x, y in zip(ra, rb)), default=0.0)
        if a
        else math.nan
    )
