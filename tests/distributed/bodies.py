"""Test bodies that run on every rank of a RankPool (imported by the workers by name).

The reference side of each comparison is a plain single-process fp32 computation: a TP=1 GPTModel
called directly (no schedule, no DDP), the loss computed with ``torch.log_softmax`` in float64,
and ``loss.backward()``. Weights travel between layouts through Megatron's own
``dist_checkpointing`` (which reshards), and so do gradients: a layout's gradients are written into
its parameters and saved, then loaded at TP=1 next to the reference.
"""

from __future__ import annotations

import torch

from megatron_p3o.checkpoint.state import load_model_state, save_model_state
from megatron_p3o.logprob.kernels import vocab_parallel_logprobs
from megatron_p3o.model.builder import BuildOptions, build_model
from megatron_p3o.model.description import ModelDescription
from megatron_p3o.model.forward import forward_backward, next_token_targets
from megatron_p3o.update.optim import (
    OptimConfig,
    UpdateSize,
    build_optimizer,
    build_scheduler,
    wrap_ddp,
    zero_grads,
)

FAMILIES = {
    "llama": dict(
        architecture="LlamaForCausalLM",
        vocab_size=300,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        rope_theta=10000.0,
        tie_word_embeddings=False,
    ),
    "qwen3": dict(
        architecture="Qwen3ForCausalLM",
        vocab_size=290,
        hidden_size=64,
        intermediate_size=96,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        rope_theta=1e6,
        tie_word_embeddings=True,
        qk_norm=True,
    ),
    "qwen2": dict(
        architecture="Qwen2ForCausalLM",
        vocab_size=260,
        hidden_size=64,
        intermediate_size=96,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        tie_word_embeddings=False,
        qkv_bias=True,
    ),
    "qwen3moe": dict(
        architecture="Qwen3MoeForCausalLM",
        vocab_size=290,
        hidden_size=64,
        intermediate_size=96,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        rope_theta=1e6,
        tie_word_embeddings=False,
        qk_norm=True,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        norm_topk_prob=True,
    ),
    "llama4l": dict(
        architecture="LlamaForCausalLM",
        vocab_size=300,
        hidden_size=64,
        intermediate_size=128,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        tie_word_embeddings=False,
    ),
}
SEQ = 32
BATCH = 4


def desc_of(family: str) -> ModelDescription:
    return ModelDescription(**FAMILIES[family])


def make_batch(family: str, seed: int = 7, batch: int = BATCH, seq: int = SEQ):
    """Deterministic tokens ``[B, S]``, next-token targets and a response mask with prompts."""
    g = torch.Generator().manual_seed(seed)
    vocab = FAMILIES[family]["vocab_size"]
    tokens = torch.randint(0, vocab, (batch, seq), generator=g)
    prompt = torch.randint(3, seq // 2, (batch,), generator=g)
    pos = torch.arange(seq)[None]
    mask = ((pos >= prompt[:, None]) & (pos < seq - 1)).float()
    mask[0, seq - 6 :] = 0.0  # a shorter response
    return {"tokens": tokens, "targets": next_token_targets(tokens), "loss_mask": mask}


def _build(family, groups, seq=SEQ, dispatcher="allgather"):
    opts = BuildOptions(seq_length=seq, moe_dispatcher=dispatcher)
    return build_model(desc_of(family), groups, opts)


def save_init(groups, family: str, out: str, seed: int = 3):
    """Random weights (norms perturbed too, so they matter) saved at this layout."""
    chunks = _build(family, groups)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in sorted(chunks[0].named_parameters()):
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    save_model_state(chunks, out)


def _split_microbatches(batch, groups, n_micro):
    dp, r = groups.layout.dp, groups.dp_rank
    b = batch["tokens"].shape[0]
    assert b % (dp * n_micro) == 0
    per = b // dp
    mine = {k: v[r * per : (r + 1) * per] for k, v in batch.items()}
    mb = per // n_micro
    return [{k: v[i * mb : (i + 1) * mb] for k, v in mine.items()} for i in range(n_micro)]


def save_grads(chunks, out: str) -> None:
    """Write each parameter's accumulated gradient (DDP ``main_grad``) into the parameter and
    save it as a checkpoint: gradients then reshard to any layout like weights."""
    with torch.no_grad():
        for c in chunks:
            for p in c.parameters():
                p.copy_(p.main_grad)
    save_model_state(chunks, out)


def nll_loss_fn(groups, vocab_size, n_global):
    """Token-mean NLL over the whole step: each micro-batch returns its sum / global count."""

    def loss_fn(batch, logits):
        lp, _ = vocab_parallel_logprobs(logits, batch["targets"], groups.tp, vocab_size=vocab_size)
        mask = batch["loss_mask"]
        loss = -(lp * mask).sum() / n_global
        return loss, int(mask.sum().item()), {"logits": logits.detach().clone(), "lp": lp.detach()}

    return loss_fn


def layout_grads(groups, family: str, init: str, out: str, n_micro: int = 1):
    """Load ``init`` at this layout, run one step's forward/backward, save the grads to ``out``."""
    chunks = _build(family, groups)
    load_model_state(chunks, init)
    ddp = wrap_ddp(chunks, groups, OptimConfig())
    batch = make_batch(family)
    n_global = batch["loss_mask"].sum()
    mbs = _split_microbatches(batch, groups, n_micro)
    zero_grads(ddp)
    outs = forward_backward(
        ddp, groups, mbs, nll_loss_fn(groups, FAMILIES[family]["vocab_size"], n_global)
    )
    save_grads(chunks, out)
    return {
        "tp_rank": groups.tp_rank,
        "cp_rank": groups.cp_rank,
        "dp_rank": groups.dp_rank,
        "last": groups.is_last_stage(),
        "outs": outs,
    }


def reference_logprobs(groups, family: str, init: str, batch):
    """A TP=1 GPTModel called directly (no schedule, no DDP): logits and float64 ℓθ ``[B, S]``."""
    lay = groups.layout
    assert lay.tp == lay.pp == lay.cp == 1
    (model,) = _build(family, groups)
    load_model_state([model], init)
    vocab = FAMILIES[family]["vocab_size"]
    pos = torch.arange(SEQ)[None].expand(batch["tokens"].shape[0], -1)
    logits = model(batch["tokens"], pos, None)
    lp = torch.log_softmax(logits[..., :vocab].double(), -1).gather(
        -1, batch["targets"][..., None]
    )[..., 0]
    return model, logits, lp


def grad_errors(groups, family: str, model, compare_dirs, dtype=torch.float32):
    """Relative L2 error of each saved grads dir against ``model``'s ``.grad`` (after backward),
    computed in ``dtype``."""
    ref = {n: p.grad.detach().to(dtype) for n, p in model.named_parameters()}
    errors = {}
    for d in compare_dirs:
        (other,) = _build(family, groups)
        load_model_state([other], d)
        errors[d] = {
            n: float((p.detach().to(dtype) - ref[n]).norm() / ref[n].norm().clamp_min(1e-30))
            for n, p in other.named_parameters()
        }
    return ref, errors


def reference(groups, family: str, init: str, compare_dirs=()):
    """TP=1 single-process fp32 reference; compares each saved grads dir against it."""
    batch = make_batch(family)
    model, logits, lp = reference_logprobs(groups, family, init, batch)
    loss = -(lp * batch["loss_mask"]).sum() / batch["loss_mask"].sum()
    loss.backward()
    ref, errors = grad_errors(groups, family, model, compare_dirs)
    vocab = FAMILIES[family]["vocab_size"]
    return {
        "logits": logits.detach()[..., :vocab],
        "lp": lp.float().detach(),
        "loss": float(loss),
        "errors": errors,
        "grad_norms": {n: float(g.norm()) for n, g in ref.items()},
    }


def resave(groups, family: str, src: str, out: str):
    """Load ``src`` at this layout and save it again (resharding round trip)."""
    chunks = _build(family, groups)
    load_model_state(chunks, src)
    save_model_state(chunks, out)


def compare_checkpoints(groups, family: str, a: str, b: str):
    """Bitwise comparison of two checkpoints loaded at this layout."""
    (ma,) = _build(family, groups)
    (mb,) = _build(family, groups)
    load_model_state([ma], a)
    load_model_state([mb], b)
    pb = dict(mb.named_parameters())
    return {n: bool(torch.equal(p, pb[n])) for n, p in ma.named_parameters()}


def optimizer_steps(groups, family: str, init: str, out: str, distributed: bool, steps: int = 2):
    """Megatron DDP + (distributed) optimizer: ``steps`` AdamW steps on the test batch."""
    chunks = _build(family, groups)
    load_model_state(chunks, init)
    cfg = OptimConfig(lr=1e-3, weight_decay=0.1, clip_grad=1.0, distributed_optimizer=distributed)
    ddp = wrap_ddp(chunks, groups, cfg)
    opt = build_optimizer(ddp, groups, cfg)
    sched = build_scheduler(opt, cfg)
    batch = make_batch(family)
    n_global = batch["loss_mask"].sum()
    norms, sizes = [], []
    for _ in range(steps):
        zero_grads(ddp, opt)
        forward_backward(
            ddp,
            groups,
            _split_microbatches(batch, groups, 1),
            nll_loss_fn(groups, FAMILIES[family]["vocab_size"], n_global),
        )
        size = UpdateSize(opt)
        ok, gnorm, _ = opt.step()
        sched.step(1)
        assert ok
        norms.append(float(gnorm))
        sizes.append(size.measure())
    save_model_state(chunks, out)
    return {"norms": norms, "sizes": sizes}


def reference_adamw(groups, family: str, init: str, trained: str, steps: int = 2):
    """torch.optim.AdamW on the whole batch, single process; compares with ``trained``."""
    (model,) = _build(family, groups)
    load_model_state([model], init)
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and not n.endswith(".bias")]
    no_decay = [
        p for n, p in model.named_parameters() if not (p.ndim >= 2 and not n.endswith(".bias"))
    ]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=1e-3,
        eps=1e-8,
    )
    batch = make_batch(family)
    vocab = FAMILIES[family]["vocab_size"]
    pos = torch.arange(SEQ)[None].expand(BATCH, -1)
    norms, sizes = [], []
    for _ in range(steps):
        before = [p.detach().double().clone() for p in model.parameters()]
        opt.zero_grad()
        logits = model(batch["tokens"], pos, None)
        lp = torch.log_softmax(logits[..., :vocab].double(), -1).gather(
            -1, batch["targets"][..., None]
        )[..., 0]
        loss = -(lp * batch["loss_mask"]).sum() / batch["loss_mask"].sum()
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)))
        opt.step()
        # float64 ‖Δθ‖ and ‖θ‖ over every parameter once (a tied embedding is one parameter)
        sizes.append(
            {
                "update_norm": float(
                    sum(((p.double() - b) ** 2).sum() for p, b in zip(model.parameters(), before))
                    ** 0.5
                ),
                "param_norm": float(sum((b**2).sum() for b in before) ** 0.5),
            }
        )
    (other,) = _build(family, groups)
    load_model_state([other], trained)
    po = dict(other.named_parameters())
    errs = {n: float((p.detach() - po[n]).abs().max()) for n, p in model.named_parameters()}
    return {"errors": errs, "norms": norms, "sizes": sizes}


def try_layout(groups, **layout_kwargs):
    """Return the error message of initializing an impossible layout (None if it worked)."""
    from megatron_p3o.runtime.parallel import Layout, initialize

    try:
        initialize(Layout(**layout_kwargs))
    except ValueError as e:
        return str(e)
    return None
