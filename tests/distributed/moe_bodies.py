"""Rank bodies of the routing-replay tests.

Reference side: transformers' Qwen3-MoE in float64 holding the same weights, with each layer's
router forced to the recorded experts (softmax over all experts, the recorded ones gathered and
renormalized: the model's own ``norm_topk_prob`` rule) — no Megatron code and none of
``model/routing.py``.
"""

from __future__ import annotations

import torch

from megatron_p3o.checkpoint.state import load_model_state
from megatron_p3o.logprob.kernels import vocab_parallel_logprobs
from megatron_p3o.model.description import description_to_hf_config
from megatron_p3o.model.forward import forward_backward, next_token_targets
from megatron_p3o.update.optim import OptimConfig, wrap_ddp, zero_grads

from .bodies import FAMILIES, _build, desc_of

B, S = 4, 16


def _batch(family, seed=3):
    g = torch.Generator().manual_seed(seed)
    d = FAMILIES[family]
    tokens = torch.randint(1, d["vocab_size"], (B, S), generator=g)
    forced = torch.stack(
        [torch.randperm(d["num_experts"], generator=g)[: d["num_experts_per_tok"]]
         for _ in range(B * S * d["num_layers"])]
    ).reshape(B, S, d["num_layers"], -1)  # fmt: skip
    forced[:, -1] = -1  # nothing recorded for the last token: the trainer's own routing
    return tokens, forced


def replay_step(groups, family, init, mode):
    """Logits and router gradients of one forward/backward with ``mode`` routing."""
    chunks = _build(family, groups)
    load_model_state(chunks, init)
    ddp = wrap_ddp(chunks, groups, OptimConfig())
    tokens, forced = _batch(family)
    dp, r = groups.layout.dp, groups.dp_rank
    rows = slice(r * B // dp, (r + 1) * B // dp)
    vocab = FAMILIES[family]["vocab_size"]
    mb = {"tokens": tokens[rows], "targets": next_token_targets(tokens[rows]),
          "route_mode": mode}  # fmt: skip
    if mode != "none":
        mb["routed_experts"] = forced[rows]
    got = {}

    def loss_fn(batch, logits):
        lp, _ = vocab_parallel_logprobs(logits, batch["targets"], groups.tp, vocab_size=vocab)
        whole = logits.detach()
        if groups.layout.tp_enabled:  # the vocabulary shards, gathered for the comparison
            parts = [torch.empty_like(whole) for _ in range(groups.layout.tp)]
            torch.distributed.all_gather(parts, whole.contiguous(), group=groups.tp)
            whole = torch.cat(parts, -1)
        got["logits"] = whole[..., :vocab].clone()
        return -lp[:, :-1].sum() / (B * (S - 1)), 0, {}

    zero_grads(ddp)
    forward_backward(ddp, groups, [mb], loss_fn)
    hooks = chunks[0].route_hooks
    agree = [float(h.agree[0] / h.agree[1]) if h.agree is not None and h.agree[1] else None
             for h in hooks]  # fmt: skip
    grads = {n: p.main_grad.clone() for n, p in chunks[0].named_parameters() if "router" in n}
    return {"logits": got.get("logits"), "rows": (rows.start, rows.stop), "router_grads": grads,
            "agree": agree}  # fmt: skip


def hf_reference(groups, family, init, forced_routes: bool):
    """float64 transformers forward/backward with the same weights (routers forced or not)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from megatron_p3o.rollout.embedded import EmbeddedEngine
    from megatron_p3o.weight_sync.source import TrainerWeights

    chunks = _build(family, groups)
    load_model_state(chunks, init)
    desc = desc_of(family)
    hf_cfg = description_to_hf_config(desc)
    engine = EmbeddedEngine(hf_cfg, "fp32")
    engine.update_weights([TrainerWeights(chunks, groups, desc).full()], 1)
    cfg = dict(hf_cfg)
    cfg = AutoConfig.for_model(cfg.pop("model_type"), **{k: v for k, v in cfg.items()
                                                         if k != "architectures"})  # fmt: skip
    model = AutoModelForCausalLM.from_config(cfg, experts_implementation="eager").double()
    model.load_state_dict({k: v.double() for k, v in engine.model.state_dict().items()})
    tokens, forced = _batch(family)
    if forced_routes:
        for i, layer in enumerate(model.model.layers):
            gate = layer.mlp.gate
            rec = forced[:, :, i].reshape(-1, forced.shape[-1])

            def fwd(h, gate=gate, rec=rec):
                h = h.reshape(-1, gate.weight.shape[1])
                logits = torch.nn.functional.linear(h, gate.weight)
                probs = torch.softmax(logits, -1)
                own = torch.topk(probs, rec.shape[-1], -1).indices
                idx = torch.where((rec >= 0).all(-1, keepdim=True), rec, own)
                top = probs.gather(1, idx)
                if desc.norm_topk_prob:
                    top = top / top.sum(-1, keepdim=True)
                return logits, top.to(h.dtype), idx

            gate.forward = fwd
    logits = model(input_ids=tokens).logits
    lp = torch.log_softmax(logits, -1)[:, :-1].gather(-1, tokens[:, 1:, None])[..., 0]
    loss = -lp.sum() / (B * (S - 1))
    loss.backward()
    grads = {f"decoder.layers.{i}.mlp.router.weight": layer.mlp.gate.weight.grad.clone()
             for i, layer in enumerate(model.model.layers)}  # fmt: skip
    return {"logits": logits.detach(), "router_grads": grads}
