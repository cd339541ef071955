"""Distributed start-up and the parallel layout: the one module that touches ``parallel_state``.

Why: Megatron-Core keeps its process groups in module globals (``parallel_state``). Letting those
globals leak into every module makes the code impossible to test layout by layout, so this module
initializes them once and hands out an explicit, frozen :class:`ParallelGroups`; everything else
(model builder, loss, ESS, weight export, trainer) receives groups as arguments.

On a machine without CUDA it also installs the CPU device shim
(:mod:`megatron_p3o.runtime.cpu_shim`) and
uses the gloo backend; with CUDA it uses NCCL and the shim stays off.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass, field
from typing import ClassVar, Dict, Optional

import torch
import torch.distributed as dist

from megatron_p3o.runtime.errors import UserError
from megatron_p3o.runtime.fields import check_ranges


@dataclass(frozen=True)
class ParallelConfig:
    """Attributes: tp / pp / cp sizes, vpp (virtual stages per rank), sequence_parallel,
    ep (expert parallelism: experts split over ep ranks) and etp (tensor parallelism inside each
    expert; None = tp), and world_size: the GPU count the recipe is written for (checked at
    launch; None = any)."""

    tp: int = 1
    pp: int = 1
    cp: int = 1
    vpp: Optional[int] = None
    sequence_parallel: bool = False
    world_size: Optional[int] = None
    ep: int = 1
    etp: Optional[int] = None

    RANGES: ClassVar[Dict[str, str]] = {
        "tp": ">= 1",
        "pp": ">= 1",
        "cp": ">= 1",
        "ep": ">= 1",
        "vpp": ">= 1",
        "etp": ">= 1",
        "world_size": ">= 1",
    }

    def __post_init__(self):
        check_ranges(self, self.RANGES, "parallel")

    def layout(self) -> "Layout":
        return Layout(
            self.tp, self.pp, self.cp, None, self.vpp, self.sequence_parallel, self.ep, self.etp
        )


class LayoutError(UserError, ValueError):
    """An impossible parallel layout; the message names the numbers involved."""


@dataclass(frozen=True)
class Layout:
    """Parallel layout of one training job.

    Attributes:
        tp: tensor-parallel size (splits attention heads, MLP and vocabulary).
        pp: pipeline-parallel size (splits the layers into stages).
        cp: context-parallel size (splits the sequence into 2·cp load-balanced chunks).
        dp: data-parallel size; ``None`` means world_size / (tp·pp·cp).
        vpp: virtual pipeline stages per rank (interleaved 1F1B); ``None`` disables it.
        sequence_parallel: Megatron sequence parallelism (GPU/TE only for now).
        ep: expert-parallel size (MoE layers: each rank holds num_experts / ep experts; the
            expert ranks are carved out of the ranks that share a pipeline stage).
        etp: tensor-parallel size inside each expert; ``None`` means tp.
    """

    tp: int = 1
    pp: int = 1
    cp: int = 1
    dp: Optional[int] = None
    vpp: Optional[int] = None
    sequence_parallel: bool = False
    ep: int = 1
    etp: Optional[int] = None

    def resolve(self, world_size: int) -> "Layout":
        """Check the layout against ``world_size`` and return it with ``dp`` filled in."""
        for name in ("tp", "pp", "cp"):
            if getattr(self, name) < 1:
                raise LayoutError(f"parallel layout: {name}={getattr(self, name)} must be >= 1")
        mp = self.tp * self.pp * self.cp
        if world_size % mp:
            raise LayoutError(
                f"parallel layout: world size {world_size} is not divisible by "
                f"tp×pp×cp = {self.tp}×{self.pp}×{self.cp} = {mp}"
            )
        dp = world_size // mp
        if self.dp is not None and self.dp != dp:
            raise LayoutError(
                f"parallel layout: dp={self.dp} but world size {world_size} / "
                f"(tp×pp×cp = {mp}) = {dp}"
            )
        if self.vpp is not None:
            if self.vpp < 1:
                raise LayoutError(f"parallel layout: vpp={self.vpp} must be >= 1")
            if self.pp < 2 and self.vpp > 1:
                raise LayoutError(f"parallel layout: vpp={self.vpp} needs pp >= 2 (pp={self.pp})")
        if self.sequence_parallel and self.tp == 1:
            raise LayoutError("parallel layout: sequence_parallel=True needs tp > 1 (tp=1)")
        etp = self.tp if self.etp is None else self.etp
        if self.ep < 1 or etp < 1:
            raise LayoutError(f"parallel layout: ep={self.ep}, etp={etp} must be >= 1")
        expert_mp = etp * self.ep * self.pp
        if world_size % expert_mp:
            raise LayoutError(
                f"parallel layout: world size {world_size} is not divisible by "
                f"etp×ep×pp = {etp}×{self.ep}×{self.pp} = {expert_mp} (the expert layers' "
                "tensor × expert × pipeline split)"
            )
        return Layout(
            self.tp,
            self.pp,
            self.cp,
            dp,
            None if self.vpp in (None, 1) else self.vpp,
            self.sequence_parallel,
            self.ep,
            etp,
        )

    # capabilities: read these instead of comparing sizes with 1
    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    @property
    def cp_enabled(self) -> bool:
        return self.cp > 1

    @property
    def dp_enabled(self) -> bool:
        return (self.dp or 1) > 1

    @property
    def ep_enabled(self) -> bool:
        return self.ep > 1

    def check_hardware(self) -> None:
        """What this machine cannot run (arithmetic is ``resolve``'s job, so a CPU can plan a GPU
        layout with ``--dry-run``). Nothing at present: sequence parallelism runs on CPU with
        the local spec's :class:`~megatron_p3o.model.local_norm.LocalRMSNorm`."""

    def check_model(
        self,
        *,
        num_layers: int,
        num_heads: int,
        num_kv_heads: int,
        num_experts: int = 0,
        expert_ffn: int = 0,
    ) -> None:
        """Refuse a model that cannot be split by this layout."""
        if self.ep > 1 and not num_experts:
            raise LayoutError(f"parallel layout: ep={self.ep} needs a mixture-of-experts model")
        if num_experts and num_experts % self.ep:
            raise LayoutError(
                f"parallel layout: num_experts={num_experts} is not divisible by ep={self.ep}"
            )
        if num_experts and self.tp > 1 and not self.sequence_parallel:
            # megatron-core's MoELayer.forward raises this at the first training forward
            raise LayoutError(
                f"parallel layout: a mixture-of-experts model at tp={self.tp} needs "
                "parallel.sequence_parallel: true (Megatron trains MoE with tensor parallelism "
                "only under sequence parallelism)"
            )
        etp = self.tp if self.etp is None else self.etp
        if num_experts and expert_ffn % etp:
            raise LayoutError(
                f"parallel layout: moe_intermediate_size={expert_ffn} is not divisible by etp={etp}"
            )
        if num_heads % self.tp:
            raise LayoutError(
                f"parallel layout: num_attention_heads={num_heads} is not divisible by tp={self.tp}"
            )
        if num_kv_heads % self.tp:
            raise LayoutError(
                f"parallel layout: num_key_value_heads={num_kv_heads} is not divisible by "
                f"tp={self.tp}"
            )
        stages = self.pp * (self.vpp or 1)
        if num_layers % stages:
            raise LayoutError(
                f"parallel layout: num_layers={num_layers} is not divisible by "
                f"pp×vpp = {self.pp}×{self.vpp or 1} = {stages}"
            )

    def check_sequence(self, seq_length: int) -> None:
        """Context parallelism splits each sequence into 2·cp equal chunks."""
        if self.cp > 1 and seq_length % (2 * self.cp):
            raise LayoutError(
                f"parallel layout: sequence length {seq_length} is not divisible by "
                f"2×cp = {2 * self.cp} (context parallelism splits it into 2·cp chunks); "
                f"pad sequences to a multiple of {2 * self.cp}"
            )


@dataclass(frozen=True)
class ParallelGroups:
    """Explicit process groups and ranks of this process for one :class:`Layout`."""

    layout: Layout
    rank: int
    world_size: int
    tp: dist.ProcessGroup
    pp: dist.ProcessGroup
    cp: dist.ProcessGroup
    dp: dist.ProcessGroup
    dp_cp: dist.ProcessGroup
    tp_cp: dist.ProcessGroup
    mp: dist.ProcessGroup
    embd: Optional[dist.ProcessGroup]
    pos_embd: Optional[dist.ProcessGroup]
    pg_collection: object = field(repr=False)  # megatron.core ProcessGroupCollection
    backend: str = "gloo"
    ep: Optional[dist.ProcessGroup] = None  # expert-parallel group (MoE layers)
    expt_tp: Optional[dist.ProcessGroup] = None  # tensor parallelism inside each expert
    expt_dp: Optional[dist.ProcessGroup] = None  # the replicas of one expert shard

    @property
    def world(self) -> dist.ProcessGroup:
        """Every rank of the job, by name: collectives that must reach all of them (a bad input
        stopping every rank, a checkpoint's rank states) say so instead of defaulting to it."""
        return dist.group.WORLD

    @property
    def ep_rank(self) -> int:
        return dist.get_rank(self.ep) if self.ep is not None else 0

    @property
    def tp_rank(self) -> int:
        return dist.get_rank(self.tp)

    @property
    def expt_tp_rank(self) -> int:
        """Rank inside the expert-TP group (the dense ``tp_rank`` need not be it: at TP 2, EP 2,
        expert-TP 1 the two TP ranks hold different experts, each whole)."""
        return dist.get_rank(self.expt_tp) if self.expt_tp is not None else 0

    @property
    def expt_dp_rank(self) -> int:
        """Which replica of this rank's expert shard it holds (0: the one a push reads)."""
        return dist.get_rank(self.expt_dp) if self.expt_dp is not None else 0

    @property
    def owns_experts(self) -> bool:
        """This rank speaks for its experts in a weight push: expert-TP rank 0 of the first
        expert-data-parallel replica (one rank per EP rank and pipeline stage)."""
        return self.expt_tp_rank == 0 and self.expt_dp_rank == 0

    @property
    def pp_rank(self) -> int:
        return dist.get_rank(self.pp)

    @property
    def cp_rank(self) -> int:
        return dist.get_rank(self.cp)

    @property
    def dp_rank(self) -> int:
        return dist.get_rank(self.dp)

    @property
    def dp_cp_rank(self) -> int:
        return dist.get_rank(self.dp_cp)

    @property
    def device(self) -> torch.device:
        """Where every tensor bound for the model or a collective lives: this rank's GPU (NCCL
        refuses CPU tensors), or the CPU under gloo. Host-side bookkeeping says so."""
        if torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    @property
    def is_dp_leader(self) -> bool:
        """The rank that speaks for its DP rank (TP = PP = CP = 0): data cursors, rollouts."""
        return self.tp_rank == 0 and self.pp_rank == 0 and self.cp_rank == 0

    def is_first_stage(self, vp_stage: Optional[int] = None) -> bool:
        return self.pp_rank == 0 and (vp_stage is None or vp_stage == 0)

    def is_last_stage(self, vp_stage: Optional[int] = None) -> bool:
        last_vp = (self.layout.vpp or 1) - 1
        return self.pp_rank == self.layout.pp - 1 and (vp_stage is None or vp_stage == last_vp)

    def last_stage_global_rank(self) -> int:
        """Global rank of the last pipeline stage in this rank's pipeline."""
        return dist.get_global_rank(self.pp, self.layout.pp - 1)


def init_distributed(backend: Optional[str] = None, timeout_minutes: int = 30) -> None:
    """Start torch.distributed from torchrun's environment (or as a single process).

    gloo without CUDA, NCCL with it. A plain ``python`` launch becomes a world of one.
    """
    if dist.is_initialized():
        return
    if "WORLD_SIZE" not in os.environ:  # a plain `python` launch: a world of one on a free port
        from megatron_p3o.runtime.ports import free_port

        os.environ.setdefault("MASTER_PORT", str(free_port()))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29500")
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend=backend, timeout=datetime.timedelta(minutes=timeout_minutes))


def initialize(layout: Layout, seed: int = 1234, backend: Optional[str] = None) -> ParallelGroups:
    """Initialize torch.distributed (if needed) and Megatron's model-parallel state for ``layout``.

    May be called again with another layout in the same process (tests switch layouts without
    restarting ranks): the previous model-parallel groups are destroyed first.
    """
    from megatron_p3o.runtime import cpu_shim

    cpu_shim.install()
    init_distributed(backend)
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    from megatron.core.process_groups_config import ProcessGroupCollection

    world = dist.get_world_size()
    layout = layout.resolve(world)
    layout.check_hardware()
    _destroy_model_parallel_groups()
    ps.initialize_model_parallel(
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        virtual_pipeline_model_parallel_size=layout.vpp,
        context_parallel_size=layout.cp,
        expert_model_parallel_size=layout.ep,
        expert_tensor_parallel_size=layout.etp,
        # On gloo every group already is a gloo group; duplicates would only add threads.
        create_gloo_process_groups=dist.get_backend() != "gloo",
    )
    # As Megatron-LM: one CPU seed per pipeline stage (TP ranks must agree: CPU initialization
    # draws the full master weight and slices it), then the named model-parallel RNG streams.
    import random

    import numpy as np

    stage_seed = seed + 100 * ps.get_pipeline_model_parallel_rank()
    random.seed(stage_seed)
    np.random.seed(stage_seed)
    torch.manual_seed(stage_seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    pgc = ProcessGroupCollection.use_mpu_process_groups(
        required_pgs=["tp", "pp", "mp", "cp", "tp_cp", "embd", "pos_embd", "dp", "dp_cp"]
    )
    # The distributed optimizer, DDP and the MoE layers also look for these.
    pgc.intra_dp_cp = ps.get_data_parallel_group(
        with_context_parallel=True, partial_data_parallel=True
    )
    pgc.expt_dp = ps.get_expert_data_parallel_group()
    pgc.intra_expt_dp = ps.get_expert_data_parallel_group(partial_expert_data_parallel=True)
    pgc.tp_ep_pp = ps.get_expert_tensor_model_pipeline_parallel_group()
    pgc.hcp = None
    pgc.ep = ps.get_expert_model_parallel_group()
    pgc.expt_tp = ps.get_expert_tensor_parallel_group()
    pgc.tp_ep = ps.get_expert_tensor_and_model_parallel_group()
    pgc.tp_dp_cp = ps.get_tensor_and_data_parallel_group(with_context_parallel=True)
    pgc.intra_dist_opt = ps.get_intra_distributed_optimizer_instance_group()
    return ParallelGroups(
        layout=layout,
        rank=dist.get_rank(),
        world_size=world,
        tp=pgc.tp,
        pp=pgc.pp,
        cp=pgc.cp,
        dp=pgc.dp,
        dp_cp=pgc.dp_cp,
        tp_cp=pgc.tp_cp,
        mp=pgc.mp,
        embd=pgc.embd,
        pos_embd=pgc.pos_embd,
        pg_collection=pgc,
        backend=dist.get_backend(),
        ep=pgc.ep,
        expt_tp=pgc.expt_tp,
        expt_dp=pgc.expt_dp,
    )


def new_object_group() -> dist.ProcessGroup:
    """A world-sized gloo group of its own (every rank must call this, in the same order).

    Why: the rollout producer thread exchanges prompts and samples (Python objects, CPU memory)
    while the training thread runs its own collectives; two threads must never share a group,
    and objects travel over gloo even where the model groups are NCCL.
    """
    return dist.new_group(backend="gloo")


def _destroy_model_parallel_groups() -> None:
    """Forget Megatron's groups *and* shut them down.

    ``destroy_model_parallel`` only drops Megatron's references; the communicators (gloo: a few
    threads each) live on. A process that switches layouts many times (the test pools, layout
    sweeps) would accumulate thousands of threads, so every group but the world is destroyed.
    """
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    if not dist.is_initialized():
        return
    from torch.distributed import distributed_c10d as c10d

    for pg in list(c10d._world.pg_map):  # no public listing of live groups exists
        if pg is not c10d.GroupMember.WORLD and pg is not None:
            dist.destroy_process_group(pg)


def destroy() -> None:
    """Tear down model-parallel state and the default process group."""
    _destroy_model_parallel_groups()
    if dist.is_initialized():
        dist.destroy_process_group()
