"""Rank body: a Megatron model at TP=2 pushes its weights into embedded engines; the fp32 engine's
sampling log-probs must equal the trainer's ``vocab_parallel_logprobs`` of the same tokens."""

from __future__ import annotations

import torch

from megatron_p3o.loss import vocab_parallel_logprobs
from megatron_p3o.model.builder import BuildOptions, build_model
from megatron_p3o.model.description import description_to_hf_config
from megatron_p3o.model.forward import forward_backward, next_token_targets
from megatron_p3o.rollout.embedded import EmbeddedEngine
from megatron_p3o.types import SamplingParams
from megatron_p3o.weight_sync import iter_hf_buckets, iter_hf_tensors

from .bodies import desc_of

SEQ = 32
PROMPTS = [[5, 17, 33, 2], [9, 4], [100, 200, 31, 7, 8, 9]]


def _trainer_logprobs(chunks, groups, samples, vocab, temperature):
    tokens = torch.zeros(len(samples), SEQ, dtype=torch.long)
    for i, s in enumerate(samples):
        seq = s.prompt_ids + s.completion_ids
        tokens[i, : len(seq)] = torch.tensor(seq)
    got = []

    def loss_fn(batch, logits):
        lp, _ = vocab_parallel_logprobs(
            logits, batch["targets"], groups.tp, temperature=temperature, vocab_size=vocab
        )
        got.append(lp.detach())
        return torch.zeros(()), 0, {}

    batch = {
        "tokens": tokens,
        "targets": next_token_targets(tokens),
        "loss_mask": torch.ones(tokens.shape),
    }
    with torch.no_grad():
        forward_backward(chunks, groups, [batch], loss_fn, forward_only=True)
    lp = got[0]
    out = []
    for i, s in enumerate(samples):
        p, c = len(s.prompt_ids), len(s.completion_ids)
        out.append(lp[i, p - 1 : p - 1 + c].tolist())
    return out


def engine_vs_trainer(
    groups, precisions=("fp32", "bf16", "fp16", "fp8", "fp8_block"), temperature=0.9
):
    desc = desc_of("llama")
    chunks = build_model(desc, groups, BuildOptions(seq_length=SEQ))
    with torch.no_grad():  # make the weights less uniform than the init
        g = torch.Generator().manual_seed(0)  # the same on every rank: norms are replicated
        for p in chunks[0].parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    buckets = list(iter_hf_buckets(iter_hf_tensors(chunks, groups, desc), 64 * 1024))
    sp = SamplingParams(temperature=temperature, max_new_tokens=10, seed=0)
    report = {"buckets": len(buckets)}
    ref_samples = None
    for prec in precisions:
        engine = EmbeddedEngine(description_to_hf_config(desc), prec)
        engine.update_weights(buckets, version=3)
        samples = engine.generate(PROMPTS, 2, sp)
        if ref_samples is None:
            ref_samples = samples
        # score the fp32 engine's samples in every precision: the same tokens, other numerics
        engine_lp = (
            engine.score(
                [s.prompt_ids for s in ref_samples], [s.completion_ids for s in ref_samples], sp
            )
            if prec != "fp32"
            else [s.logprobs for s in samples]
        )
        trainer_lp = _trainer_logprobs(chunks, groups, ref_samples, desc.vocab_size, temperature)
        diffs = [abs(a - b) for ra, rb in zip(engine_lp, trainer_lp) for a, b in zip(ra, rb)]
        report[prec] = {
            "max": max(diffs),
            "mean": sum(diffs) / len(diffs),
            "version": samples[0].weight_version,
        }
    return report


def colocated_push(groups, url: str, server_tp: int):
    """The colocated round trip of one trainer step through the real collective code: the
    server frees its memory before the update, then every trainer rank that shares a server
    rank's GPU builds that rank's IPC payload of each bucket and rank 0 posts them."""
    from megatron_p3o.parallel import new_object_group
    from megatron_p3o.rollout.central import CentralEngine
    from megatron_p3o.rollout.sglang import SGLangConfig, SGLangEngine, SGLangFleet

    inner = None
    if groups.rank == 0:
        srv = SGLangEngine(SGLangConfig(url=url, tp_size=server_tp, startup_timeout_s=10))
        inner = SGLangFleet(srv, [srv]).start()
    eng = CentralEngine(inner, groups, new_object_group(), "colocated")

    class Weights:  # what TrainerWeights.full() hands every rank: the full tensors
        def full(self):
            g = torch.Generator().manual_seed(0)
            return [(f"w{i}", torch.randn(300_000, generator=g)) for i in range(3)]

    eng.release_memory()
    eng.update_weights_colocated(Weights(), version=4, server_tp=server_tp)
    return eng.weight_version
