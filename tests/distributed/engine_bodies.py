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


def _perturbed(groups, family):
    desc = desc_of(family)
    chunks = build_model(desc, groups, BuildOptions(seq_length=SEQ))
    with torch.no_grad():
        g = torch.Generator().manual_seed(groups.rank)  # ranks differ: each must send its own
        for p in chunks[0].parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    return desc, chunks


def colocated_push(
    groups, url: str, server_tp: int, family: str = "llama", bucket_bytes: int = 16 * 1024
):
    """The colocated round trip of two trainer steps through the real collective code: the
    server frees its memory before the update, then trainer ranks 0…T−1 (which share server
    ranks' GPUs) receive each bucket from the rank that holds it and serialize it, and rank 0
    posts the payloads. ``TrainerWeights.full`` (the whole model on every rank) must not be
    called. Returns (version, the full model as the all-gather path makes it (rank 0), the
    largest bucket any rank built in bytes, the collective calls of the second push by kind)."""
    from collections import Counter
    from unittest import mock

    from megatron_p3o.rollout import central
    from megatron_p3o.rollout.central import CentralEngine
    from megatron_p3o.rollout.sglang import SGLangConfig, SGLangEngine, SGLangFleet
    from megatron_p3o.runtime.parallel import new_object_group
    from megatron_p3o.weight_sync import colocated
    from megatron_p3o.weight_sync.source import TrainerWeights

    desc, chunks = _perturbed(groups, family)
    weights = TrainerWeights(chunks, groups, desc)
    reference = {n: t.clone() for n, t in weights.full()}  # the all-gather path, to compare
    inner = None
    if groups.rank == 0:
        srv = SGLangEngine(SGLangConfig(url=url, tp_size=server_tp, startup_timeout_s=10))
        inner = SGLangFleet(srv, [srv]).start()
    eng = CentralEngine(inner, groups, new_object_group(), "colocated")
    largest, aliased = [0], [0]
    real = colocated.ColocatedPlan.buckets
    calls: Counter = Counter()
    params = {p.untyped_storage().data_ptr() for c in chunks for p in c.parameters()}

    def counted(*a, **k):
        for b in real(*a, **k):
            if b is not None:
                largest[0] = max(largest[0], sum(t.numel() * t.element_size() for _, t in b))
                aliased[0] += sum(t.untyped_storage().data_ptr() in params for _, t in b)
            yield b

    def counting(module, name):
        fn = getattr(module, name)

        def call(*a, **k):
            calls[name] += 1
            return fn(*a, **k)

        return mock.patch.object(module, name, call)

    def whole_model(self):
        raise AssertionError("a colocated push gathered the whole model on a rank")

    with (
        mock.patch.object(TrainerWeights, "full", whole_model),
        mock.patch.object(colocated.ColocatedPlan, "buckets", counted),
    ):
        for version in (3, 4):  # the second push runs on the plan the first one made
            calls.clear()
            eng.release_memory()
            with (
                counting(colocated, "broadcast"),
                counting(colocated, "all_gather_objects"),
                counting(central, "gather_objects"),
                counting(central, "barrier"),
            ):
                eng.update_weights_colocated(weights, version, server_tp, bucket_bytes=bucket_bytes)
    plan = eng._plan[1]
    stats = {"calls": dict(calls), "rounds": plan.rounds, "tensors": len(reference),
             "buckets": sum(len(s.buckets) for s in plan.segments),
             "aliased": aliased[0]}  # fmt: skip
    return eng.weight_version, reference if groups.rank == 0 else None, largest[0], stats


def stream_push(groups, family: str = "qwen3moe", bucket_bytes: int = 4 * 1024):
    """The push to rank 0 (the gloo group, tensor payloads and disk pushes all stream to it):
    every (name, tensor) rank 0 receives, and the model as the all-gather path makes it."""
    from megatron_p3o.weight_sync.source import TrainerWeights

    desc, chunks = _perturbed(groups, family)
    weights = TrainerWeights(chunks, groups, desc)
    got = [(n, t.clone()) for n, t in weights.to_rank0(bucket_bytes)]
    full = {n: t.clone() for n, t in weights.full()}
    return {"rank": groups.rank, "got": got, "full": full if groups.rank == 0 else None}


def stream_missing_peer(groups, family: str = "qwen3moe", wait_s: float = 2.0):
    """An EP rank that never sends its experts (it is told it owns none): the stage's sender
    stops after ``wait_s`` with an error that names the rank, instead of waiting forever.
    Returns the error on the sender."""
    from unittest import mock

    import torch.distributed as dist

    from megatron_p3o.runtime.collectives import CollectiveTimeout
    from megatron_p3o.runtime.parallel import ParallelGroups
    from megatron_p3o.weight_sync.stream import iter_hf_tensors_to_rank0

    desc, chunks = _perturbed(groups, family)
    silent = groups.ep_rank != 0  # the fault: the EP ranks > 0 think they own no experts
    err = None
    with mock.patch.object(
        ParallelGroups, "owns_experts", property(lambda g: not silent and g.expt_tp_rank == 0)
    ):
        try:
            for _ in iter_hf_tensors_to_rank0(chunks, groups, desc, wait_s=wait_s):
                pass
        except CollectiveTimeout as e:
            err = str(e)
    # world: the sender has given up (gloo closed its EP pair on the timeout: that group is
    # dropped with the layout; the world group is intact)
    dist.barrier()
    return {"rank": groups.rank, "error": err}


def _async_sends(pending: list):
    """``dist.send`` and ``dist.send_object_list`` that return before the receiver has taken the
    data, as NCCL's point-to-point sends do (they are queued on a CUDA stream); gloo's block."""
    import pickle

    import torch.distributed as dist

    def send(tensor, dst, group=None, tag=0):
        pending.append(dist.isend(tensor, dst=dst, group=group, tag=tag))

    def send_object_list(objs, dst, group=None, device=None):
        datas = [torch.frombuffer(bytearray(pickle.dumps(o)), dtype=torch.uint8) for o in objs]
        sizes = torch.tensor([d.numel() for d in datas], dtype=torch.long)
        pending.append(dist.isend(sizes, dst=dst, group=group))
        pending.append(dist.isend(torch.cat(datas), dst=dst, group=group))

    return send, send_object_list


def stream_in_flight(groups, bucket_bytes: int = 8 * 1024, delay_s: float = 0.01):
    """A PP push to rank 0 with a slow consumer (``delay_s`` per tensor, as an HTTP push is) and
    sends that do not block (NCCL's): every stage logs (time, +bytes) when its sender's export
    yields a tensor; rank 0 logs (time, −bytes, stage) when it takes one. Returns this rank's
    log and, on rank 0, the stream's names and tensors."""
    import time
    from unittest import mock

    from megatron_p3o.weight_sync import stream
    from megatron_p3o.weight_sync.source import TrainerWeights

    desc = desc_of("llama4l")
    chunks = build_model(desc, groups, BuildOptions(seq_length=SEQ))
    log = []
    real = stream.iter_hf_tensors

    def logged(*a, **k):
        for name, t in real(*a, **k):
            if groups.tp_rank == 0:
                log.append((time.monotonic(), t.numel() * t.element_size(), name))
            yield name, t

    pending: list = []
    send, send_objects = _async_sends(pending)
    got = []
    with (
        mock.patch.object(stream, "iter_hf_tensors", logged),
        mock.patch.object(stream.dist, "send", send),
        mock.patch.object(stream.dist, "send_object_list", send_objects),
    ):
        for name, t in TrainerWeights(chunks, groups, desc).to_rank0(bucket_bytes):
            time.sleep(delay_s)
            got.append((time.monotonic(), -(t.numel() * t.element_size()), name))
        for w in pending:
            w.wait()
    full = {n: t.clone() for n, t in TrainerWeights(chunks, groups, desc).full()}
    return {"rank": groups.rank, "pp": groups.pp_rank, "produced": log, "taken": got,
            "full": full if groups.rank == 0 else None}  # fmt: skip
