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
  * kept graphs (``batch.keep_graphs``, P3O/P4O with several micro-batches per DP rank, PP = 1,
    dense models): e_B from the gradient pass's own forwards keeps every micro-batch's autograd
    graph until its backward, so the step's whole activations live at once —
    :class:`~megatron_p3o.update.step_memory.GraphShape`'s per-token account of the tensors
    autograd saves (within 1% of the measured peak of the tiny recipe's step on CPU), for the
    step's tokens per rank taken at their most (every sequence ``model.seq_length`` long).
    ``always`` counts it in place of one micro-batch's activations and logits; ``auto`` prints
    it beside the total: the trainer keeps the graphs only when its own step's figure fits in
    half of the memory left, else it takes the pre-pass.
Rollout-engine memory: a colocated SGLang server (``weight_sync: colocated``, launched with
``--enable-memory-saver``) frees its weights and KV cache while the trainer updates, but while it
generates it holds ``mem_fraction_static`` of the GPU next to the trainer's resident state
(parameters, gradients, optimizer, reference; activations and logits are gone by then): that sum
must fit too, or the dry run refuses the recipe. "Gone" assumes what the trainer does: it
returns PyTorch's cached blocks to the driver (``torch.cuda.empty_cache()`` on every rank, then a
barrier) before the server resumes its weights and again before it resumes its KV cache —
memory the caching allocator keeps reserved is not free for SGLang. During the push itself the
server holds its weights again (the served model ÷ its TP size) and each receiving trainer rank
the push buffers (:func:`megatron_p3o.weight_sync.colocated.push_buffer_bytes`: three 256 MiB
buckets, each up to one tensor over): that sum must fit as well.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from megatron_p3o.config.train_config import TrainConfig
from megatron_p3o.model.builder import padded_vocab_size
from megatron_p3o.model.description import ModelDescription
from megatron_p3o.runtime.errors import ConfigError

GiB = 2**30
_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
HEADROOM = 0.9  # a plan fits when its estimate stays under 90% of the GPU


def describe_model(cfg: TrainConfig) -> Tuple[ModelDescription, int]:
    """The model description (and make_vocab_size_divisible_by) from the checkpoint if it exists,
    else from ``model.hf_config``."""
    ckpt = Path(cfg.model.checkpoint)
    if cfg.model.checkpoint and (ckpt / "p3o_model.json").is_file():
        from megatron_p3o.model.hf.dist_stream import read_meta

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
    kept_graphs_gib: Optional[float] = None  # batch.keep_graphs: auto (beside the total)

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
    from megatron_p3o.runtime.parallel import LayoutError

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
    kept = kept_graph_gib(cfg, desc, seqs // dp, s * b, vpad)
    if kept is not None and cfg.batch.keep_graphs == "always":
        gib.pop("activations")
        gib.pop("logits")
        gib["kept graphs"] = kept
        kept = None
    return Plan(world_size, tp, pp, cp, dp, micro, total, n, gib, kept)


def kept_graph_gib(
    cfg: TrainConfig, desc: ModelDescription, seqs: int, largest: int, vpad: int
) -> Optional[float]:
    """GiB of a step's kept graphs on one rank (``batch.keep_graphs``), or None where the step
    takes no e_B from kept graphs (``never``, no e_B of scope step, PP > 1, MoE, one micro-batch
    per rank): ``seqs`` sequences of ``model.seq_length`` tokens (÷ CP), the largest
    micro-batch ``largest`` tokens of this rank; the masks of packed windows taken full."""
    import torch

    from megatron_p3o.loss import build_objective
    from megatron_p3o.model.local_attention import PACK_WINDOW
    from megatron_p3o.update.step_memory import GraphShape

    b, p = cfg.batch, cfg.parallel
    obj = build_objective(cfg.loss.objective, **cfg.loss.hyper)
    tokens = seqs * cfg.model.seq_length // max(p.cp, 1)
    if (b.keep_graphs == "never" or not obj.needs_ess or cfg.loss.ess_scope != "step"
            or p.pp > 1 or desc.is_moe or tokens <= largest):  # fmt: skip
        return None
    tp = p.tp
    local = cfg.model.use_te is False
    shape = GraphShape(
        hidden=desc.hidden_size, ffn=desc.intermediate_size // tp, heads=desc.num_heads // tp,
        kv_heads=max(desc.num_kv_heads // tp, 1), head_dim=desc.head_dim,
        layers=desc.num_layers, act_bytes=_BYTES[cfg.model.params_dtype], vocab_rows=vpad // tp,
        local_window=PACK_WINDOW if local else None, fused=cfg.model.fused_logprob,
        sequence_parallel_tp=tp if p.sequence_parallel else 1,
    )  # fmt: skip
    window = min(PACK_WINDOW, b.max_tokens_per_gpu or 0)
    masks = shape.mask_bytes([window] * (tokens // window)) if window > 1 else 0.0
    device = torch.device("cpu" if local else "cuda")
    packed = b.max_tokens_per_gpu is not None
    return (tokens * shape.per_token(packed) + masks + shape.transient(largest, device)) / GiB


def uses_reference(cfg: TrainConfig) -> bool:
    from megatron_p3o.loss import build_objective

    obj = build_objective(cfg.loss.objective, **cfg.loss.hyper)
    return cfg.reference.wanted(obj, cfg.r2po.enabled)


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
    if plan.kept_graphs_gib is not None:
        lines.append(
            f"  (kept graphs {plan.kept_graphs_gib:.2f} GiB at most, beside the total: "
            "batch.keep_graphs: auto takes e_B from the gradient pass's own forwards when a "
            "step's graphs fit in half the memory left, else the ESS pre-pass)"
        )
    if "reference" in plan.gib:
        every = c.reference.reset_every
        lines.append(
            "  (reference model: one more no-grad forward per optimizer step, ≈ 1/3 of its "
            f"compute; reset {'every ' + str(every) + ' steps' if every else 'never'})"
        )
    verdict = (
        "fits" if plan.total_gib <= gpu_gib * HEADROOM else "DOES NOT FIT (keep ≥ 10% headroom)"
    )
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
    served = 1 if r.sglang.quantization == "fp8" else _BYTES.get(r.sglang.dtype, 2)
    from megatron_p3o.rollout.central import COLOCATED_BUCKET_BYTES
    from megatron_p3o.weight_sync.colocated import push_buffer_bytes

    desc, _ = describe_model(cfg)
    pb = _BYTES[cfg.model.params_dtype]
    largest = max(desc.vocab_size, desc.intermediate_size) * desc.hidden_size * pb
    return {
        "trainer": resident,
        "server": r.sglang.mem_fraction_static * gpu_gib,
        "server_weights": plan.params_total * served / r.sglang.tp_size / 2**30,
        "push": push_buffer_bytes(COLOCATED_BUCKET_BYTES, largest) / 2**30,
    }


def _with(cfg: TrainConfig, section: str, **changes) -> TrainConfig:
    from dataclasses import replace

    return replace(cfg, **{section: replace(getattr(cfg, section), **changes)})


def _candidates(cfg: TrainConfig, world: int):
    """One-knob changes, cheapest first: ``(--set text, config, world)``. Switches that cost
    nothing (sequence parallelism, the distributed optimizer, bf16 gradient reduction when
    training in 16 bits), a smaller micro-batch or token budget, more model parallelism on the
    same GPUs, then more GPUs."""
    p, b, o = cfg.parallel, cfg.batch, cfg.optim
    switches = [
        ("parallel", "sequence_parallel", True, p.tp > 1 and not p.sequence_parallel),
        ("optim", "distributed_optimizer", True, not o.distributed_optimizer),
        ("optim", "grad_reduce_in_fp32", False,
         o.grad_reduce_in_fp32 and cfg.model.params_dtype != "float32"),
    ]  # fmt: skip
    for section, key, value, useful in switches:
        if useful:
            yield (
                f"{section}.{key}={str(value).lower()}",
                _with(cfg, section, **{key: value}),
                world,
            )
    if b.max_tokens_per_gpu is not None:
        key, now = "max_tokens_per_gpu", b.max_tokens_per_gpu
    else:
        key, now = "micro_batch_size", b.micro_batch_size
    for f in (2, 4, 8):
        if now // f >= 1:
            yield f"batch.{key}={now // f}", _with(cfg, "batch", **{key: now // f}), world
    for f in (2, 4, 8):
        yield f"parallel.tp={p.tp * f}", _with(cfg, "parallel", tp=p.tp * f), world
        yield f"parallel.pp={p.pp * f}", _with(cfg, "parallel", pp=p.pp * f), world
    for f in (2, 4, 8):
        yield (
            f"parallel.world_size={world * f}",
            _with(cfg, "parallel", world_size=world * f),
            (world * f),
        )


def _total(cfg: TrainConfig, world: int, desc, div: int):
    try:
        return make_plan(cfg, world, desc, div).total_gib
    except (ConfigError, ValueError, ZeroDivisionError):
        return None  # not a valid layout or batch split with this change


def fixes_that_fit(cfg: TrainConfig, world: int, desc, div: int, gpu_gib: float, most: int = 2):
    """Up to ``most`` of the smallest changes after which the estimate fits, as
    ``[(--set items, total GiB)]``: single changes in :func:`_candidates`' order, else pairs of
    them (fewest GPUs first, then the one closest to the limit: the least change)."""
    limit = HEADROOM * gpu_gib
    singles = []
    for text, c, w in _candidates(cfg, world):
        total = _total(c, w, desc, div)
        if total is not None and total <= limit:
            singles.append((text, total))
    if singles:
        return singles[:most]
    pairs = {}
    for text, c, w in _candidates(cfg, world):
        for text2, c2, w2 in _candidates(c, w):
            if text2.split("=")[0] == text.split("=")[0]:
                continue
            total = _total(c2, w2, desc, div)
            key = frozenset((text, text2))
            if total is not None and total <= limit and key not in pairs:
                pairs[key] = (w2, -total, f"{text} --set {text2}")
    best = sorted(pairs.values())[:most]  # fewest GPUs, then the least change (most used)
    return [(text, -neg) for _, neg, text in best]


def does_not_fit(cfg: TrainConfig, plan: Plan, world: int, desc, div: int, gpu_gib: float):
    """The one-line refusal of a plan over the headroom: its largest items and the smallest
    changes that fit."""
    top = sorted(plan.gib.items(), key=lambda kv: -kv[1])[:3]
    items = ", ".join(f"{k} {v:.1f}" for k, v in top)
    fixes = fixes_that_fit(cfg, world, desc, div, gpu_gib)
    how = (
        "fits with --set " + " or --set ".join(f"{t} ({g:.1f} GiB)" for t, g in fixes)
        if fixes
        else "no change of one or two of TP, PP, micro-batch or GPU count makes it fit"
    )
    return ConfigError(
        f"does not fit: {plan.total_gib:.1f} GiB per GPU > {HEADROOM:.0%} of {gpu_gib:g} GiB "
        f"(largest: {items} GiB); {how}"
    )


def placement(cfg: TrainConfig, world: int, gpus_per_node: int, nodes: int | None) -> str:
    """Where the trainer and the rollout servers run, as ``tools/slurm/p3o.sbatch`` places
    them: training on the first world/gpus_per_node nodes (or GPUs 0..world−1 of one node), one
    SGLang server per ``tp_size`` GPUs on every other GPU of the job."""
    r, g = cfg.rollout, gpus_per_node
    train_nodes = max(1, -(-world // g))
    train = f"trainer {world} GPU{'s' * (world > 1)} ({train_nodes} node{'s' * (train_nodes > 1)})"
    if r.engine != "sglang":
        return f"GPUs: {train}; rollouts: the embedded engine inside the trainer's processes"
    sg = r.sglang
    if sg.url is not None:
        return f"GPUs: {train}; rollouts: the SGLang server attached at {sg.url} (not counted)"
    if r.weight_sync == "colocated":
        return f"GPUs: {train}; rollouts: a colocated SGLang server on the trainer's GPUs"
    if sg.device == "cpu":
        return f"GPUs: {train}; rollouts: one SGLang server on the CPU"
    tp = sg.tp_size
    if world < g:  # one node: the servers take the GPUs training leaves free
        servers = (g - world) // tp
        if servers < 1:
            raise ConfigError(
                f"rollout.sglang.tp_size={tp}: a {g}-GPU node training on {world} GPUs has "
                f"{g - world} left for SGLang servers (--gpus-per-node {g})"
            )
        rollout_nodes, where = 0, "on the same node"
    else:
        rollout_nodes = max(1, (nodes or train_nodes + 1) - train_nodes)
        servers, where = rollout_nodes * (g // tp), f"on {rollout_nodes} node(s)"
    total_nodes = train_nodes + rollout_nodes
    if nodes is not None and nodes < total_nodes:
        raise ConfigError(
            f"--nodes {nodes}: the recipe trains on {train_nodes} node(s) of {g} GPUs and "
            f"needs at least one more for its SGLang servers ({total_nodes} in all)"
        )
    least = "at least " if nodes is None and world >= g else ""
    more = f"; every node past the {train_nodes} training ones serves" if least else ""
    return (
        f"GPUs: {train} + rollout {servers * tp} ({servers} SGLang server"
        f"{'s' * (servers > 1)} × tp {tp}, {where}) = {least}{total_nodes} node"
        f"{'s' * (total_nodes > 1)} × {g} GPUs, {total_nodes * g} in all "
        f"(sbatch --nodes {total_nodes} tools/slurm/p3o.sbatch RECIPE{more})"
    )


def dry_run(
    recipe: str,
    cfg: TrainConfig,
    world_size: int,
    gpu_gib: float,
    gpus_per_node: int = 8,
    nodes: int | None = None,
) -> int:
    """``train --dry-run``: the layout and batch checks, the memory estimate and the placement,
    printed; a plan over the headroom, or a colocated server that cannot fit next to the
    trainer, is refused (one line, exit 2) after the breakdown is printed."""
    desc, div = describe_model(cfg)
    plan = make_plan(cfg, world_size, desc, div)
    lines = format_plan(cfg, plan, desc, gpu_gib)
    lines.append(placement(cfg, world_size, gpus_per_node, nodes))
    mt = cfg.rollout.multi_turn
    if mt is not None and mt.env:  # imported and built once: a wrong name or argument (an
        from megatron_p3o.env.config import env_class  # OpenEnv URL) is one line now

        env_class(mt)
    if cfg.rollout.engine == "sglang":  # this machine's driver and GPUs (a login node: none)
        from megatron_p3o.rollout.sglang.preflight import report

        lines += report()
    if plan.total_gib > HEADROOM * gpu_gib:
        print("\n".join(lines))  # the breakdown, then the one-line refusal on stderr
        raise does_not_fit(cfg, plan, world_size, desc, div, gpu_gib)
    co = colocated_rollout_gib(cfg, plan, gpu_gib)
    if co:
        total, limit = co["trainer"] + co["server"], HEADROOM * gpu_gib
        frac = cfg.rollout.sglang.mem_fraction_static
        lines.append(
            f"while the colocated server generates: trainer {co['trainer']:.2f} GiB resident + "
            f"server {co['server']:.2f} GiB (mem_fraction_static {frac}) = {total:.2f} GiB "
            "(activations and logits returned to the driver before each resume: empty_cache)"
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
        push = co["trainer"] + co["server_weights"] + co["push"]
        lines.append(
            f"during a colocated push: trainer {co['trainer']:.2f} GiB resident + server weights "
            f"{co['server_weights']:.2f} GiB + push buffers {co['push']:.2f} GiB = {push:.2f} GiB"
        )
        if push > limit:
            raise ConfigError(
                f"a colocated push needs {push:.1f} GiB per GPU (trainer {co['trainer']:.1f} + "
                f"server weights {co['server_weights']:.1f} + push buffers {co['push']:.1f}) > "
                f"90% of {gpu_gib:.0f} GiB; shrink the trainer's state or raise "
                "rollout.sglang.tp_size (--dry-run prints the breakdown)"
            )
    d = cfg.data
    if d.task:  # train.py wrote (or found) the splits: cfg.with_task_files()
        n_train, n_held = (len(Path(p).read_text().splitlines()) for p in (d.path, d.eval_path))
        lines.append(
            f"data: {d.task} ({d.task_format}) {dict(d.task_args)}, task seed {d.task_seed}: "
            f"{n_train} train / {n_held} held-out problems in {Path(d.path).parent}"
        )
    print(f"{recipe}: OK (world size {world_size})")
    print("\n".join(lines))
    return 0
