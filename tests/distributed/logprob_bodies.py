"""Rank body: vocab-parallel log-probs of a shared random logits tensor, sharded by TP rank."""

import torch

from megatron_p3o.loss import vocab_parallel_logprobs

N_TOK, VOCAB, VPAD = 37, 300, 320


def full_inputs(seed=0, vocab=VOCAB):
    g = torch.Generator().manual_seed(seed)
    logits = 1.2 * torch.randn(3, N_TOK, VPAD, generator=g)
    logits[..., vocab:] = 50.0  # padded columns must not count, however large
    targets = torch.randint(0, vocab, (3, N_TOK), generator=g)
    w_lp = torch.randn(3, N_TOK, generator=g)
    w_h = torch.randn(3, N_TOK, generator=g)
    return logits, targets, w_lp, w_h


def shard_logprobs(
    groups,
    temperature: float,
    chunk_size,
    dtype: str = "float32",
    inplace: bool = False,
    entropy: bool = True,
    vocab: int = VOCAB,
):
    logits, targets, w_lp, w_h = full_inputs(vocab=vocab)
    tp, r = groups.layout.tp, groups.tp_rank
    v = VPAD // tp
    shard = logits[..., r * v : (r + 1) * v].to(getattr(torch, dtype)).clone().requires_grad_()
    lp, ent = vocab_parallel_logprobs(
        shard,
        targets,
        groups.tp,
        temperature=temperature,
        chunk_size=chunk_size,
        with_entropy=entropy,
        vocab_size=vocab,
        inplace_backward=inplace,
    )
    loss = (lp * w_lp).sum() + ((ent * w_h).sum() if entropy else 0.0)
    loss.backward()
    return {
        "lp": lp.detach(),
        "ent": ent.detach() if entropy else None,
        "grad": shard.grad.float().clone(),
        "tp_rank": r,
    }
