"""One rollout server for the whole job (SGLang or its router), driven from global rank 0.

Why: every trainer rank talking to the server would send each prompt TP×PP×CP times; and the
server's weights must be updated once, not once per rank. So the *leader* of each DP rank (its
TP = PP = CP = 0 rank) hands its prompts to global rank 0, which sends them all to the server in
one concurrent batch and hands each DP rank its samples back; the other model-parallel ranks get
a copy of their leader's samples (they need identical batches). Every call is a collective over
a gloo group of its own (``parallel.new_object_group``), made in the same order on every rank
(the rollout scheduler's batches and dynamic-sampling rounds), so it also works from the
scheduler's producer thread.

Weights: the trainer streams full HF tensors to rank 0 after each sync point
(:func:`megatron_p3o.weight_sync.stream.iter_hf_tensors_to_rank0`); rank 0 pushes them with the
configured method (a process-group broadcast, tensor payloads, CUDA IPC when colocated, or a
safetensors directory on shared disk); every rank records the new version. Samples carry the
versions SGLang reports (per token when a push came mid-request).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Iterable, List, Optional, Sequence

import torch.distributed as dist

from megatron_p3o.rollout.engine import Bucket, RolloutEngine
from megatron_p3o.runtime.collectives import (
    all_gather_objects,
    barrier,
    gather_objects,
    scatter_objects,
)
from megatron_p3o.runtime.parallel import ParallelGroups
from megatron_p3o.types import Sample, SamplingParams

COLOCATED_BUCKET_BYTES = 256 * 2**20  # per colocated push bucket (plan.py counts three)


def return_cached_memory(objects: dist.ProcessGroup, why: str) -> None:
    """Every rank gives PyTorch's cached, unused GPU blocks back to the driver, then waits for
    the others: a colocated server resumes into fresh physical memory, and blocks the caching
    allocator keeps reserved are not free for it (nothing to do without CUDA)."""
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    barrier(objects, why)


class CentralEngine(RolloutEngine):
    """``inner`` exists on global rank 0 only (None elsewhere)."""

    def __init__(
        self,
        inner: Optional[RolloutEngine],
        groups: ParallelGroups,
        objects: dist.ProcessGroup,
        weight_sync: str = "distributed",
        sync_dir: str = "",
        hf_config: Optional[dict] = None,
    ):
        if (groups.rank == 0) != (inner is not None):
            raise ValueError("CentralEngine: the server engine lives on global rank 0 only")
        self.inner, self.groups = inner, groups
        self.objects = objects  # parallel.new_object_group(): this engine's own gloo group
        self.weight_sync, self.sync_dir, self.hf_config = weight_sync, sync_dir, hf_config
        self._released = False  # colocated: the server gave its GPU memory back (rank 0)
        self._plan = None  # colocated: (receivers, bucket bytes), ColocatedPlan, made once
        self.name = f"central({inner.name if inner else 'remote'})"
        self.weight_version = inner.weight_version if inner is not None else 0
        self.leader = groups.is_dp_leader

    # -- collectives over the gloo objects group ------------------------------------------------
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        n: int,
        sampling: SamplingParams,
        keys: Optional[Sequence[str]] = None,
    ) -> List[Sample]:
        g = self.groups
        mine = (
            g.dp_rank,
            [list(p) for p in prompts] if self.leader else None,
            list(keys) if self.leader and keys is not None else None,
        )
        why = "every DP leader's prompts (and routing keys) to the rank that talks to the server"
        gathered = gather_objects(mine, 0, self.objects, why)
        out: List[Optional[dict]] = [None] * g.world_size
        if g.rank == 0:
            flat, flat_keys, owners = [], [], []
            for dp_rank, ps, ks in gathered:
                if ps is not None:
                    owners.append((dp_rank, len(flat), len(ps)))
                    flat += ps
                    flat_keys += ks if ks is not None else [None] * len(ps)
            routed = flat_keys if any(k is not None for k in flat_keys) else None
            samples = self.inner.generate(flat, n, sampling, routed) if flat else []
            by_dp = {}
            for dp_rank, start, count in owners:
                part = [s for s in samples if start <= s.group_id < start + count]
                for s in part:
                    s.group_id -= start
                by_dp[dp_rank] = part
            out = [by_dp.get(d, []) for d, _, _ in gathered]
        samples = scatter_objects(out if g.rank == 0 else None, 0, self.objects,
                                  "each rank receives its DP rank's samples")  # fmt: skip
        for s in samples:
            self.weight_version = max(self.weight_version, s.weight_version)
        return samples

    def rollout_turns(self, loop, prompts, items, n, sampling) -> List[Sample]:
        """Multi-turn: every DP rank's trajectories run on rank 0, each against the server on
        its own (:func:`~megatron_p3o.rollout.turn_ranks.central_turns`; collective, once per
        rollout)."""
        from megatron_p3o.rollout.turn_ranks import central_turns

        samples = central_turns(self, loop, prompts, items, n, sampling)
        for s in samples:
            self.weight_version = max(self.weight_version, s.weight_version)
        return samples

    def any_rank(self, flag: bool) -> bool:
        flags = all_gather_objects(
            bool(flag), self.objects, "dynamic-sampling rounds are taken by all ranks or none"
        )
        return any(flags)

    # -- weights --------------------------------------------------------------------------------
    def update_weights(self, buckets: Iterable[Bucket], version: int) -> None:
        """Rank 0 pushes (others pass an empty iterable); no collective: called where only rank 0
        holds the tensors."""
        if self.inner is not None:
            if self.weight_sync == "disk":
                self._push_from_disk(buckets, version)
            else:
                self.inner.update_weights(buckets, version)
        else:
            for _ in buckets:
                pass
        self.weight_version = version

    def release_memory(self) -> None:
        """Colocated, before the trainer's update: the server stops generating, then frees its
        GPU memory (SGLang asserts an idle server unless paused, and a paused server runs no
        forward — not even ``/health``'s — on the released memory). Collective: nobody
        allocates before rank 0 has heard back."""
        if self.inner is not None:
            self.inner.pause_generation()
            self.inner.release_memory()
            self._released = True
        barrier(self.objects, "the trainer ranks sharing the server's GPUs wait for the release")

    def update_weights_colocated(
        self,
        weights,
        version: int,
        server_tp: int,
        fp8: bool = False,
        bucket_bytes: int = COLOCATED_BUCKET_BYTES,
    ) -> None:
        """Colocated CUDA-IPC push (collective). Each bucket is built on trainer ranks 0…T−1,
        which share the GPUs of server ranks 0…T−1, by the plan made once per run
        (:class:`~megatron_p3o.weight_sync.colocated.ColocatedPlan`: no rank ever holds the
        whole model, one broadcast per bucket); each serializes its copy, and rank 0 sends
        payload r to server rank r. On the server, in this order: (pause, if the server was not
        released) → resume weights → begin → the buckets → end → resume the KV cache and CUDA
        graphs → continue. Before each resume every rank returns PyTorch's cached blocks to the
        driver (the training step's activations and logits, then the push's buffers): SGLang
        resumes into fresh physical memory. ``fp8``: block-FP8 weights plus scales
        (:func:`~megatron_p3o.weight_sync.fp8.quantize_named`)."""
        from megatron_p3o.rollout.sglang.protocol import (
            RESUME_AFTER_PUSH,
            RESUME_BEFORE_PUSH,
            with_last,
        )
        from megatron_p3o.weight_sync.ipc import payload_ranks, serialize_named_tensors

        g = self.groups
        ranks = payload_ranks(server_tp, g.world_size)
        plan = self._colocated_plan(weights, ranks, bucket_bytes)
        transform = None
        if fp8:
            from megatron_p3o.weight_sync.fp8 import quantize_named

            def transform(named):
                return list(quantize_named(named))

        released, inner = self._released, self.inner
        if inner is not None and not released:
            inner.pause_generation()  # a push into a server that was generating
        return_cached_memory(self.objects, "the step's activations and logits go back to the "
                             "driver before the server takes its weights back")  # fmt: skip
        if inner is not None:
            if released:
                inner.resume_memory(list(RESUME_BEFORE_PUSH))
            inner.begin_weight_update()
        for bucket, last in with_last(plan.buckets(weights, transform)):
            blob = serialize_named_tensors(bucket) if bucket is not None else None
            blobs = gather_objects(blob, 0, self.objects, "every server TP rank's payload "
                                   "to rank 0, which posts them")  # fmt: skip
            if inner is not None:
                inner.push_ipc([blobs[r] for r in ranks], version, last)
            barrier(self.objects, "the handles' tensors stay alive until the server loaded them")
            del bucket, blob
        if inner is not None:
            inner.end_weight_update()
        return_cached_memory(self.objects, "the push's buffers go back to the driver before "
                             "the server takes its KV cache back")  # fmt: skip
        if inner is not None:
            if released:
                inner.resume_memory(list(RESUME_AFTER_PUSH))
            inner.continue_generation()
        self._released = False
        self.weight_version = version

    def _colocated_plan(self, weights, receivers, bucket_bytes: int):
        """The colocated push's plan, made on the first push (collective) and kept."""
        from megatron_p3o.weight_sync.colocated import ColocatedPlan

        key = (tuple(receivers), bucket_bytes)
        if self._plan is None or self._plan[0] != key:
            self._plan = (key, ColocatedPlan.build(weights, self.objects, receivers, bucket_bytes))
        return self._plan[1]

    def _push_from_disk(self, buckets: Iterable[Bucket], version: int) -> None:
        """Write an HF safetensors directory (atomically) and ask the server to load it."""
        from megatron_p3o.model.hf.safetensors_io import HFShardedWriter, atomic_dir

        out = Path(self.sync_dir) / f"v{version:06d}"
        if not out.exists():
            with atomic_dir(out) as tmp:
                w = HFShardedWriter(tmp)
                for bucket in buckets:
                    for name, t in bucket:
                        w.add(name, t.detach().cpu())
                w.close()
                if self.hf_config is not None:
                    (tmp / "config.json").write_text(json.dumps(self.hf_config, indent=2))
        self.inner.update_weights_from_disk(str(out), version)
        for old in sorted(Path(self.sync_dir).glob("v*")):  # keep the newest two
            if old.is_dir() and old.name < f"v{version - 1:06d}":
                shutil.rmtree(old, ignore_errors=True)

    def health(self) -> dict:
        return (
            self.inner.health()
            if self.inner is not None
            else {"ok": True, "weight_version": self.weight_version}
        )

    def stop(self) -> None:
        if self.inner is not None:
            self.inner.stop()
