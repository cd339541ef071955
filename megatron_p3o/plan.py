"""Dry run: check a recipe's layout and batch arithmetic and estimate memory per GPU, without a
GPU, a checkpoint or a process group (``python -m megatron_p3o.train RECIPE --dry-run``).

Why: a 70B recipe that does not fit, or whose global batch does not split over DP × micro-batch,
should fail on a laptop in a second, not after a 20-minute queue wait and a model load.

Memory model (per GPU, the most loaded pipeline stage; an estimate, not a measurement):
  * parameters: the stage's layers ÷ TP (norms replicated), embedding on the first stage,
    output layer on the last (vocabulary padded as the builder pads it), in ``params_dtype``;
  * gradients: Megatron DDP's buffer, fp32 when ``grad_reduce_in_fp32`` else ``params_dtype``;
  * optimizer: Adam m and v in fp32, plus an fp32 master copy when training in 16 bits — divided
    by DP×CP with the distributed optimizer;
  * activations (Korthikanti et al. 2022, flash attention so no s² term, no recomputation): per
    layer and micro-batch ≈ s·b·h·(10 + 24/t) bytes, or 34·s·b·h/t with sequence parallelism,
    with s·b the tokens of one micro-batch ÷ CP — ``batch.max_tokens_per_gpu`` when packing
    (a sample longer than the budget gets its own micro-batch: the larger of the budget and
    ``model.seq_length``), else micro_batch_size × seq_length; 1F1B keeps min(PP, micro-batches)
    micro-batches alive on the first stage; plus the fp32 logits of one micro-batch (s·b·V/t·4)
    on the last stage.
Rollout-engine memory: a colocated SGLang server (``weight_sync: colocated``, launched with
``--enable-memory-saver``) frees its weights and KV cache while the trainer updates, but while it
generates it holds ``mem_fraction_static`` of the GPU next to the trainer's resident state
(parameters, gradients, optimizer, reference; activations and logits are gone by then): that sum
must fit too, or the dry run refuses the recipe.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Tuple

from .config import ConfigError, TrainConfig
from .model.builder import padded_vocab_size
from .model.description import ModelDescription

GiB = 2**30
_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def describe_model(cfg: TrainConfig) -> Tuple[ModelDescription, int]:
    """The model description (and make_vocab_size_divisible_by) from the checkpoint if it exists,
    else from ``model.hf_config``."""
    ckpt = Path(cfg.model.checkpoint)
    if cfg.model.checkpoint and (ckpt / "p3o_model.json").is_file():
        from .hf.dist_stream import read_meta

        meta = read_meta(ckpt)
        return meta["description"], int(meta["make_vocab_size_divisible_by"])
    if cfg.model.hf_config:
        p = Path(cfg.model.hf_config)
        if not p.is_file():
            raise ConfigError(f"model.hf_config={cfg.model.hf_config!r} does not exist")
        return ModelDescription.from_hf_config(json.loads(p.read_text()), str(p)), 128
    raise ConfigError(
        f"model.checkpoint={cfg.model.checkpoint!r} has no p3o_model.json and "
        "model.hf_config is not set: the dry run needs one of them"
    )


def layer_params(d: ModelDescription) -> Tuple[int, int]:
    """(TP-sharded, replicated) parameter counts of one transformer layer, without its routed
    experts (:func:`expert_params`); an MoE layer's router is replicated."""
    q = d.num_heads * d.head_dim
    kv = d.num_kv_heads * d.head_dim
    sharded = d.hidden_size * (q + 2 * kv) + q * d.hidden_size
    if not d.is_moe:
        sharded += 3 * d.hidden_size * d.intermediate_size
    if d.qkv_bias:
        sharded += q + 2 * kv
    replicated = 2 * d.hidden_size + (2 * d.head_dim if d.qk_norm else 0)
    if d.is_moe:
        replicated += d.hidden_size * d.num_experts
    return sharded, replicated


def expert_params(d: ModelDescription) -> int:
    """Routed-expert parameters of one layer (SwiGLU: 3·h·ffn each), split over ep × etp."""
    return d.num_experts * 3 * d.hidden_size * d.moe_intermediate_size


@dataclass
class Plan:
    world_size: int
    tp: int
    pp: int
    cp: int
    dp: int
    micro_batches: int
    params_total: int
    params_per_gpu: int
    gib: Dict[str, float]

    @property
    def total_gib(self) -> float:
        return sum(self.gib.values())


def make_plan(
    cfg: TrainConfig, world_size: int, desc: ModelDescription, divisible_by: int = 128
) -> Plan:
    """Layout + batch arithmetic (``cfg.validate``) and the memory estimate of the busiest GPU."""
    cfg.validate(world_size)
    p = cfg.parallel
    tp, pp, cp = p.tp, p.pp, p.cp
    dp = world_size // (tp * pp * cp)
    from .parallel import LayoutError

    try:
        p.layout().resolve(world_size).check_model(
            num_layers=desc.num_layers, num_heads=desc.num_heads, num_kv_heads=desc.num_kv_heads,
            num_experts=desc.num_experts, expert_ffn=desc.moe_intermediate_size,
        )  # fmt: skip
    except LayoutError as e:
        raise ConfigError(str(e)) from None
    vpad = padded_vocab_size(desc.vocab_size, tp, divisible_by)
    sh, rep = layer_params(desc)
    ex = expert_params(desc)
    lay = p.layout().resolve(world_size)
    ex_split = lay.ep * lay.etp  # each GPU holds experts / ep, each split over etp
    h, L = desc.hidden_size, desc.num_layers
    emb = vpad * h
    out = 0 if desc.tie_word_embeddings else vpad * h
    total = L * (sh + rep + ex) + desc.vocab_size * h * (1 if desc.tie_word_embeddings else 2) + h
    per_stage = -(-L // pp)
    n_ex = per_stage * ex // ex_split
    first = per_stage * (sh // tp + rep) + emb // tp + (out // tp + h if pp == 1 else 0)
    last = (
        per_stage * (sh // tp + rep)
        + out // tp
        + h
        + (emb // tp if desc.tie_word_embeddings and pp > 1 else 0)
    )
    n_dense = max(first, last)
    n = n_dense + n_ex
    pb = _BYTES[cfg.model.params_dtype]
    o = cfg.optim
    grads = n * (4 if o.grad_reduce_in_fp32 else pb)
    moments = 4 if o.moments_dtype == "bfloat16" else 8  # Adam's two moments
    per_param = moments + (4 if pb < 4 else 0)
    opt = n_dense * per_param + n_ex * per_param
    if o.distributed_optimizer:  # dense state over DP×CP, expert state over expert-DP
        expert_dp = world_size // (lay.etp * lay.ep * pp)
        opt = n_dense * per_param / (dp * cp) + n_ex * per_param / expert_dp
    seqs = cfg.batch.prompts_per_rollout * cfg.rollout.n_samples // cfg.batch.minibatches
    budget = cfg.batch.max_tokens_per_gpu
    if budget is None:  # padded: micro_batch_size rows of seq_length
        micro = seqs // (dp * cfg.batch.micro_batch_size)
        s, b = cfg.model.seq_length // cp, cfg.batch.micro_batch_size
    else:  # packed: one row of at most the token budget (the count depends on the lengths,
        # at most one micro-batch per sequence; 1F1B then keeps pp of them alive)
        micro = max(pp, 1)
        s, b = max(budget, cfg.model.seq_length) // cp, 1
    per_layer = s * b * h * ((34 / tp) if p.sequence_parallel else (10 + 24 / tp))
    act = per_layer * per_stage * min(pp, micro)
    logits = s * b * vpad / tp * 4
    gib = {
        "parameters": n * pb / GiB,
        "gradients": grads / GiB,
        "optimizer": opt / GiB,
        "activations": act / GiB,
        "logits": logits / GiB,
    }
    if uses_reference(cfg):  # a second, frozen copy of the stage's parameters, no grads/optimizer
        gib["reference"] = n * pb / GiB
    if cfg.r2po.enabled:  # W₁ (d×d) + W₂ shard (V/tp×d), fp32: weights, grads, Adam's 2 moments
        gib["rollout head"] = (h * h + vpad // tp * h) * 16 / GiB
    return Plan(world_size, tp, pp, cp, dp, micro, total, n, gib)


def uses_reference(cfg: TrainConfig) -> bool:
    from .loss import build_objective

    on = cfg.reference.enabled
    if on is None:
        obj = build_objective(cfg.loss.objective, **cfg.loss.hyper)
        on = obj.needs_ref_logprobs or cfg.r2po.enabled
    return bool(on)


def format_plan(
    cfg: TrainConfig, plan: Plan, desc: ModelDescription, gpu_gib: float = 80.0
) -> List[str]:
    c = cfg
    vpp = f" (vpp {c.parallel.vpp})" if c.parallel.vpp else ""
    sp = " + sequence parallel" if c.parallel.sequence_parallel else ""
    dist_opt = "on" if c.optim.distributed_optimizer else "off"
    lines = [
        f"model: {desc.architecture}, {plan.params_total / 1e9:.2f} B parameters, "
        f"{desc.num_layers} layers, hidden {desc.hidden_size}, vocab {desc.vocab_size}",
        f"layout: world {plan.world_size} = tp {plan.tp} × pp {plan.pp} × cp {plan.cp} × "
        f"dp {plan.dp}{vpp}{sp}"
        + (
            f"; experts: {desc.num_experts} × top-{desc.num_experts_per_tok} over ep "
            f"{c.parallel.ep} × etp {c.parallel.etp or c.parallel.tp}"
            if desc.is_moe
            else ""
        ),
        c.batch_arithmetic(plan.dp),
        f"memory per GPU (estimate, busiest stage; {plan.params_per_gpu / 1e9:.2f} B parameters "
        f"on it, {c.model.params_dtype}, distributed optimizer {dist_opt}):",
    ]
    for k, v in plan.gib.items():
        lines.append(f"  {k:<12} {v:8.2f} GiB")
    if "reference" in plan.gib:
        every = c.reference.reset_every
        lines.append(
            "  (reference model: one more no-grad forward per optimizer step, ≈ 1/3 of its "
            f"compute; reset {'every ' + str(every) + ' steps' if every else 'never'})"
        )
    verdict = "fits" if plan.total_gib <= gpu_gib * 0.9 else "DOES NOT FIT (keep ≥ 10% headroom)"
    lines.append(f"  {'total':<12} {plan.total_gib:8.2f} GiB of {gpu_gib:.0f} GiB — {verdict}")
    return lines


_TRANSIENT = ("activations", "logits")  # freed between the update and the next rollout


def colocated_rollout_gib(cfg: TrainConfig, plan: Plan, gpu_gib: float) -> Dict[str, float]:
    """While a colocated server generates: the trainer's resident GiB and the server's
    (``mem_fraction_static`` × the GPU); empty when the server is not colocated."""
    r = cfg.rollout
    if r.engine != "sglang" or r.weight_sync != "colocated":
        return {}
    resident = sum(v for k, v in plan.gib.items() if k not in _TRANSIENT)
    return {"trainer": resident, "server": r.sglang.mem_fraction_static * gpu_gib}


def dry_run(recipe: str, cfg: TrainConfig, world_size: int, gpu_gib: float) -> int:
    """``train --dry-run``: the layout and batch checks and the memory estimate, printed; a
    colocated server that cannot fit next to the trainer is refused."""
    desc, div = describe_model(cfg)
    plan = make_plan(cfg, world_size, desc, div)
    lines = format_plan(cfg, plan, desc, gpu_gib)
    co = colocated_rollout_gib(cfg, plan, gpu_gib)
    if co:
        total, limit = co["trainer"] + co["server"], 0.9 * gpu_gib
        frac = cfg.rollout.sglang.mem_fraction_static
        lines.append(
            f"while the colocated server generates: trainer {co['trainer']:.2f} GiB resident + "
            f"server {co['server']:.2f} GiB (mem_fraction_static {frac}) = {total:.2f} GiB"
        )
        if total > limit:
            room = max(0.0, (limit - co["trainer"]) / gpu_gib)
            raise ConfigError(
                f"rollout.sglang.mem_fraction_static={frac}: a colocated server takes "
                f"{co['server']:.1f} GiB next to the trainer's {co['trainer']:.1f} GiB resident "
                f"(parameters, gradients, optimizer) = {total:.1f} GiB > 90% of {gpu_gib:.0f} "
                f"GiB; use mem_fraction_static <= {int(room * 100) / 100:.2f} or shrink the "
                "trainer's state (--dry-run prints the breakdown)"
            )
    d = cfg.data
    if d.task:  # resolve_task wrote (or found) the splits when the recipe was loaded
        n_train, n_held = (len(Path(p).read_text().splitlines()) for p in (d.path, d.eval_path))
        lines.append(
            f"data: {d.task} ({d.task_format}) {dict(d.task_args)}, task seed {d.task_seed}: "
            f"{n_train} train / {n_held} held-out problems in {Path(d.path).parent}"
        )
    print(f"{recipe}: OK (world size {world_size})")
    print("\n".join(lines))
    return 0
