"""Samples → training micro-batches: padded ``[b, s]`` rows or packed ``[1, T]`` (THD) rows.

Position t of a sequence predicts token t+1, so completion token j (at sequence position
p + j, p = prompt length) is scored at position p + j − 1. The model side of a micro-batch is
``tokens`` / ``targets`` / ``position_ids`` (and ``cu_seqlens`` when packed); the loss side is
the nested ``response`` dict of ``[n, L]`` tensors over the n sequences' completion tokens
(L = the longest completion), with ``index`` pointing each completion token at its scoring
position in the flattened token grid. The loss never sees padding or prompt positions, and the
same response tensors serve a padded, a packed and a context-parallel forward.

Packed micro-batches (``batch.max_tokens_per_gpu``): each optimizer step's samples are first
balanced over DP ranks by tokens, then split into the fewest micro-batches that fit the token
budget, as even as possible (:mod:`megatron_p3o.update.balance`). Each sequence is padded to a
multiple of 2·cp (context parallelism cuts it into 2·cp chunks), each micro-batch to a multiple
of cp·tp (sequence parallelism) — times 16 under FP8 training (:func:`token_multiple`) — and,
under pipeline parallelism, to the step's longest
micro-batch (the stages exchange fixed-shape activations); that padding is one filler sequence
at the end that nobody scores.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import chain
from typing import ClassVar, Dict, List, Literal, Optional, Sequence, Tuple

import numpy as np
import torch

from megatron_p3o.model.forward import MicroBatch
from megatron_p3o.runtime.collectives import all_max, all_sum
from megatron_p3o.runtime.errors import DataError
from megatron_p3o.runtime.fields import check_choice, check_ranges
from megatron_p3o.runtime.parallel import ParallelGroups
from megatron_p3o.types import Sample
from megatron_p3o.update.balance import agree_on_count, balance_over_dp, imbalance, pack_by_budget

KEEP_GRAPHS = ("auto", "always", "never")  # batch.keep_graphs (:mod:`.kept_graphs`)
KEEP_LOGITS = ("auto", "never")  # batch.keep_logits (:mod:`megatron_p3o.logprob.fused`)


@dataclass(frozen=True)
class BatchConfig:
    """Attributes:
    prompts_per_rollout: prompts per rollout batch (× n_samples sequences).
    minibatches: optimizer steps per rollout batch.
    epochs: passes over the rollout batch.
    micro_batch_size: sequences per padded micro-batch per DP rank (when
        ``max_tokens_per_gpu`` is None: every sequence padded to ``model.seq_length``).
    max_tokens_per_gpu: token budget of one packed micro-batch (None = padded micro-batches).
    balance_dp: spread each optimizer step's tokens evenly over DP ranks (packed mode).
    mask_truncated: completions cut by ``max_new_tokens`` (finish reason "length") get no loss:
        their tokens leave the loss and its normalizer (they still count for advantages).
    keep_graphs: e_B of a step of several micro-batches per DP rank (P3O, P4O: ESS scope
        "step") from the gradient pass's own forwards, run first with their autograd graphs
        kept, instead of a no-grad pre-pass (one forward fewer; the same numbers):
        "auto" when the step's graphs fit in half the memory left (no pipelining, dense
        models), "always" whenever the layout allows, "never" (the pre-pass).
    keep_logits: the fused log-prob kernel (``model.fused_logprob``) keeps each chunk's logits
        for its backward instead of recomputing them (one output-layer matmul fewer per
        micro-batch, the same numbers): "auto" where they fit beside the step's graphs in the
        same room as ``keep_graphs`` (:meth:`~megatron_p3o.update.step_memory.StepNeed.logits_fit`),
        "never" (the recompute: nothing of size T × V/tp between the passes).
    """

    prompts_per_rollout: int = 64
    minibatches: int = 1
    epochs: int = 1
    micro_batch_size: int = 4
    max_tokens_per_gpu: Optional[int] = None
    balance_dp: bool = True
    mask_truncated: bool = False
    keep_graphs: Literal["auto", "always", "never"] = "auto"
    keep_logits: Literal["auto", "never"] = "auto"

    RANGES: ClassVar[Dict[str, str]] = {
        "prompts_per_rollout": ">= 1",
        "minibatches": ">= 1",
        "epochs": ">= 1",
        "micro_batch_size": ">= 1",
        "max_tokens_per_gpu": ">= 1",
    }

    def __post_init__(self):
        check_ranges(self, self.RANGES, "batch")
        check_choice("batch.keep_graphs", self.keep_graphs, KEEP_GRAPHS)
        check_choice("batch.keep_logits", self.keep_logits, KEEP_LOGITS)


# Transformer Engine's FP8 GEMMs need each rank's token rows divisible by 8 (16 for some
# kernels): every micro-batch's tokens per rank (÷ cp, ÷ tp under sequence parallelism) pad to 16.
FP8_ROWS = 16


def token_multiple(layout, fp8: bool = False) -> int:
    """What a packed micro-batch's token count must be a multiple of: 2·cp (CP chunks), cp·tp
    under sequence parallelism (each rank's shard), and 16 rows per rank under FP8 training."""
    align = 2 * layout.cp if layout.cp_enabled else 1
    tp_sp = layout.tp if layout.sequence_parallel else 1
    return math.lcm(align, layout.cp * tp_sp * (FP8_ROWS if fp8 else 1))


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def _sequence(s: Sample, seq_length: int, name: int) -> List[int]:
    seq = s.prompt_ids + s.completion_ids
    if len(seq) > seq_length:
        raise DataError(
            f"sample {name} (prompt group {s.group_id}) has {len(seq)} tokens "
            f"> model.seq_length={seq_length}; raise seq_length or lower max_new_tokens"
        )
    return seq


def _response(
    samples: Sequence[Sample],
    advantages: Sequence[float],
    starts: Sequence[int],
    ids,
    mask_truncated: bool = False,
) -> Dict[str, torch.Tensor]:
    """The ``[n, L]`` loss-side tensors of sequences starting at flattened ``starts``; with
    ``mask_truncated`` a completion that hit the length budget keeps mask 0, and so does one
    whose advantage is NaN (a sequence its objective skips, e.g. R2PO's all-equal groups)."""
    n = len(samples)
    # Whole-batch numpy, no per-sample rows: the kept samples' values flattened in order fill
    # the grid's live cells (row-major, as their rows would); Python floats round to float32 to
    # nearest either way.
    plen = np.fromiter((len(s.prompt_ids) for s in samples), np.int64, n)
    clen = np.fromiter((len(s.completion_ids) for s in samples), np.int64, n)
    per_token = any(isinstance(a, (list, tuple)) for a in advantages)  # multi-turn credit: turn
    adv = np.zeros(n) if per_token else np.asarray(advantages, dtype=np.float64).reshape(n)
    keep = (clen > 0) & ~np.isnan(adv)
    if mask_truncated:
        keep &= np.fromiter((s.finish_reason != "length" for s in samples), bool, n)
    longest = max(int(clen.max(initial=0)), 1)
    col = np.arange(longest)
    live = (col[None, :] < clen[:, None]) & keep[:, None]
    kept = [s for s, k in zip(samples, keep.tolist()) if k]
    grid = np.zeros((3, n, longest), np.float32)
    # the policy's tokens only: a multi-turn trajectory's environment tokens (mask 0) reach no
    # ratio, ESS, KL, entropy or normaliser
    grid[0][live] = np.fromiter(
        chain.from_iterable(
            s.policy_mask if s.policy_mask is not None else (1.0,) * len(s.completion_ids)
            for s in kept
        ),
        np.float32,
    )
    grid[1][live] = np.fromiter(chain.from_iterable(s.logprobs for s in kept), np.float32)
    if per_token:  # one value per completion token (its turn's); a scalar for every token
        rows = (a if isinstance(a, (list, tuple)) else (a,) * int(c)
                for a, c, k in zip(advantages, clen, keep.tolist()) if k)  # fmt: skip
        grid[2][live] = np.fromiter(chain.from_iterable(rows), np.float32)
    else:
        grid[2] = np.where(live, adv.astype(np.float32)[:, None], np.float32(0.0))
    first = np.asarray(starts, dtype=np.int64).reshape(n) + plen - 1  # each completion's row
    index = np.where(live, first[:, None] + col[None, :], 0)
    mask, blp, adv = torch.from_numpy(grid)
    index = torch.from_numpy(index)
    return {
        "mask": mask,
        "behavior_logprobs": blp,
        "advantages": adv,
        "index": index,
        "sample_index": torch.as_tensor(list(ids), dtype=torch.long),  # host
    }


def _routes(samples: Sequence[Sample], starts: Sequence[int], b: int, s: int):
    """``[b, s, layers, k]`` int16 grid of the engine's recorded experts (MoE), -1 where none
    were recorded (each sequence's last token, padding, fillers); None when no sample has any."""
    have = [x.routed_experts for x in samples if x.routed_experts is not None]
    if not have:
        return None
    grid = torch.full((b * s,) + tuple(have[0].shape[1:]), -1, dtype=torch.int16)  # host
    for x, a in zip(samples, starts):
        r = x.routed_experts
        if r is not None:
            grid[a : a + r.shape[0]] = r.to(torch.int16)
    return grid.reshape((b, s) + tuple(have[0].shape[1:]))


def _with_routes(mb: MicroBatch, samples, starts, mode: Optional[str]) -> MicroBatch:
    """Adds ``routed_experts`` and ``route_mode`` (``rollout.routing_replay``) for MoE."""
    if mode is None:
        return mb
    b, s = mb["tokens"].shape
    grid = _routes(samples, starts, b, s)
    if grid is not None:
        mb["routed_experts"] = grid
    mb["route_mode"] = mode
    return mb


def padded_microbatches(
    samples: Sequence[Sample],
    advantages,
    seq_length: int,
    micro_batch_size: int,
    pad_id: int = 0,
    first_index: int = 0,
    mask_truncated: bool = False,
    route_mode: Optional[str] = None,
) -> List[MicroBatch]:
    """Samples (in order) in micro-batches of ``micro_batch_size`` rows of ``seq_length``;
    ``route_mode`` (MoE): carry the engine's recorded experts (see :mod:`.model.routing`)."""
    if len(samples) % micro_batch_size:
        raise ValueError(
            f"{len(samples)} samples do not split into micro-batches of {micro_batch_size}"
        )
    adv = [a if isinstance(a, (list, tuple)) else float(a) for a in advantages]
    out = []
    for k in range(0, len(samples), micro_batch_size):
        part = samples[k : k + micro_batch_size]
        tokens = torch.full((len(part), seq_length), pad_id, dtype=torch.long)  # host
        targets = torch.full_like(tokens, pad_id)
        for i, s in enumerate(part):
            seq = torch.tensor(_sequence(s, seq_length, first_index + k + i))  # host
            tokens[i, : len(seq)] = seq
            targets[i, : len(seq) - 1] = seq[1:]
        ids = range(first_index + k, first_index + k + len(part))
        starts = [i * seq_length for i in range(len(part))]
        mb = {
            "tokens": tokens,
            "targets": targets,
            "response": _response(part, adv[k : k + len(part)], starts, ids, mask_truncated),
        }
        out.append(_with_routes(mb, part, starts, route_mode))
    return out


def packed_microbatch(
    samples: Sequence[Sample],
    advantages: Sequence[float],
    ids: Sequence[int],
    seq_length: int,
    pad_id: int = 0,
    align: int = 1,
    multiple: int = 1,
    pad_to: int = 0,
    mask_truncated: bool = False,
    route_mode: Optional[str] = None,
) -> MicroBatch:
    """One ``[1, T]`` row: the samples back to back, each padded to a multiple of ``align``,
    plus one unscored filler sequence up to a multiple of ``multiple`` (and ``pad_to``)."""
    seqs = [_sequence(s, seq_length, i) for s, i in zip(samples, ids)]
    lens = [_round_up(max(len(q), 1), align) for q in seqs]
    total = sum(lens)
    target = max(_round_up(max(total, 1), multiple), pad_to)
    if target > total:
        lens.append(target - total)
        seqs.append([])
    # one host array per row, filled by whole-batch numpy (see _response): each sequence's
    # tokens, its next-token targets, then padding; positions restart at every sequence
    width = np.asarray(lens, dtype=np.int64)
    have = np.fromiter((len(q) for q in seqs), np.int64, len(seqs))
    starts_np = np.concatenate(([0], np.cumsum(width)))
    offset = np.arange(target) - np.repeat(starts_np[:-1], width)  # position in its sequence
    seg_len = np.repeat(have, width)
    grid = np.full((3, target), pad_id, dtype=np.int64)
    grid[0][offset < seg_len] = np.fromiter(chain.from_iterable(seqs), np.int64)
    grid[1][offset < seg_len - 1] = np.fromiter(chain.from_iterable(q[1:] for q in seqs), np.int64)
    grid[2] = offset
    grid = torch.from_numpy(grid)
    starts = starts_np.tolist()
    mb = {
        "tokens": grid[0:1],
        "targets": grid[1:2],
        "position_ids": grid[2:3],
        "cu_seqlens": torch.tensor(starts, dtype=torch.int32),  # host
        "response": _response(samples, advantages, starts[: len(samples)], ids, mask_truncated),
    }
    return _with_routes(mb, samples, starts[: len(samples)], route_mode)


def real_tokens(samples: Sequence[Sample]) -> int:
    return sum(len(s.prompt_ids) + len(s.completion_ids) for s in samples)


class MicroBatcher:
    """Builds every optimizer step's micro-batches of one rollout batch on this rank.

    ``equal_counts``: every DP rank gets the same number of micro-batches per step (needed when
    a collective runs per micro-batch, e.g. ESS scope "microbatch"). Under expert parallelism
    every forward exchanges tokens with the other expert-parallel ranks (DP ranks of the dense
    layers): counts are then always equal, and packed micro-batches share one token count
    (Megatron's allgather dispatcher gathers equal shapes).
    """

    def __init__(
        self,
        cfg: BatchConfig,
        groups: ParallelGroups,
        seq_length: int,
        pad_id: int,
        equal_counts: bool = False,
        route_mode: Optional[str] = None,
        fp8: bool = False,
    ):
        self.cfg, self.groups, self.seq_length, self.pad_id = cfg, groups, seq_length, pad_id
        self.route_mode = route_mode  # MoE: "r3" replays the engine's experts, "off" compares
        lay = groups.layout
        self.equal_shapes = lay.ep_enabled
        self.equal_counts = equal_counts or lay.ep_enabled
        self.align = 2 * lay.cp if lay.cp_enabled else 1
        self.multiple = token_multiple(lay, fp8)

    def token_cost(self, s: Sample) -> int:
        """Tokens a sample occupies in a packed micro-batch."""
        return _round_up(max(len(s.prompt_ids) + len(s.completion_ids), 1), self.align)

    def build(self, samples: Sequence[Sample], advantages) -> Tuple[List[List[MicroBatch]], Dict]:
        """``(micro-batches of each optimizer step, packing metrics)``; mini-batch m holds the
        m-th consecutive slice of this rank's samples."""
        n_steps = self.cfg.minibatches
        per = len(samples) // n_steps
        # floats, read at once from a tensor (the same values as float() of each element); a
        # list per sample under multi-turn turn credit
        if torch.is_tensor(advantages):
            adv = advantages.tolist()
        else:
            adv = [a if isinstance(a, (list, tuple)) else float(a) for a in advantages]
        steps, stats = [], []
        for m in range(n_steps):
            sl = slice(m * per, (m + 1) * per)
            if self.cfg.max_tokens_per_gpu is None:
                mbs = padded_microbatches(
                    samples[sl], adv[sl], self.seq_length, self.cfg.micro_batch_size,
                    self.pad_id, m * per, self.cfg.mask_truncated, self.route_mode,
                )  # fmt: skip
                st = {}
                real = real_tokens(samples[sl])
            else:
                mbs, st, real = self._packed(samples[sl], adv[sl], m * per)
            st.update(_shape_stats(mbs, real))
            steps.append(mbs)
            stats.append(st)
        return steps, self._reduce(stats)

    def _packed(self, samples, adv, first: int):
        g = self.groups
        lengths = [self.token_cost(s) for s in samples]
        items = list(zip(samples, adv))
        if self.cfg.balance_dp and g.layout.dp_enabled:
            mine, st = balance_over_dp(items, lengths, g.dp, g.dp_rank)
            mine = [(first + i, it) for i, it in mine]
            lens = [self.token_cost(it[0]) for _, it in mine]
        else:  # this rank's samples, in order (one DP rank: balancing keeps them as they are)
            off = first + g.dp_rank * len(items)  # names unique over DP (equal shares)
            mine, st, lens = [(off + i, it) for i, it in enumerate(items)], {}, lengths
        budget = self.cfg.max_tokens_per_gpu
        bins, oversize = pack_by_budget(lens, budget)
        if self.equal_counts:
            count = agree_on_count(len(bins), g.dp, g.device)
            if count != len(bins):
                bins, oversize = pack_by_budget(lens, budget, min_count=count)
        pad_to = 0
        if g.layout.pp_enabled or self.equal_shapes:  # one activation shape for the schedule
            pad_to = max(_round_up(max(sum(lens[i] for i in b), 1), self.multiple) for b in bins)
        if self.equal_shapes:  # ... and for every expert-parallel rank's token dispatch
            pad_to = agree_on_count(pad_to, g.dp, g.device)
        mbs = []
        for b in bins:
            chosen = [mine[i] for i in b]
            mbs.append(
                packed_microbatch(
                    [it[0] for _, it in chosen],
                    [it[1] for _, it in chosen],
                    [gid for gid, _ in chosen],
                    self.seq_length,
                    self.pad_id,
                    self.align,
                    self.multiple,
                    pad_to,
                    self.cfg.mask_truncated,
                    self.route_mode,
                )  # fmt: skip
            )
        st["oversize_samples"] = float(oversize)
        return mbs, st, real_tokens([it[0] for _, it in mine])

    def _reduce(self, stats: List[Dict]) -> Dict[str, float]:
        """Mean over the rollout batch's optimizer steps; sums and maxima over DP ranks."""
        keys = ("real", "computed", "n_micro", "oversize_samples")
        dev, dp, n_steps = self.groups.device, self.groups.layout.dp, len(stats)
        t = torch.tensor(
            [sum(s.get(k, 0.0) for s in stats) for k in keys], dtype=torch.float64, device=dev
        )
        per_rank = torch.zeros(n_steps, dp, dtype=torch.float64, device=dev)
        per_rank[:, self.groups.dp_rank] = torch.tensor([s["real"] for s in stats])  # host
        m = torch.tensor([max(s["max_tokens"] for s in stats)], dtype=torch.float64, device=dev)
        if self.groups.layout.dp_enabled:
            grp = self.groups.dp
            all_sum(t, grp, "packing metrics: the step's padding and shapes over every DP rank")
            all_sum(per_rank, grp, "packing metrics: every DP rank's token load")
            all_max(m, grp, "packing metrics: the largest micro-batch over every DP rank")
        real, computed, n_micro, oversize = t.tolist()
        out = {
            "pad_fraction": 1.0 - real / max(computed, 1.0),
            "tokens_per_microbatch_mean": computed / max(n_micro, 1.0),
            "tokens_per_microbatch_max": float(m),
            "microbatches_per_rank": n_micro / (dp * n_steps),
            # real tokens of the busiest DP rank over the mean, per optimizer step
            "dp_token_imbalance": sum(imbalance(r) for r in per_rank.tolist()) / n_steps,
            "oversize_samples": oversize / dp,
        }
        before = [s["dp_token_imbalance_before"] for s in stats if "dp_token_imbalance_before" in s]
        if before:
            out["dp_token_imbalance_before"] = sum(before) / len(before)
        return out


def _shape_stats(mbs: List[MicroBatch], real: int) -> Dict[str, float]:
    sizes = [int(mb["tokens"].numel()) for mb in mbs]
    return {
        "real": float(real),
        "computed": float(sum(sizes)),
        "n_micro": float(len(mbs)),
        "max_tokens": float(max(sizes)),
    }


def stack_padded(microbatches: List[MicroBatch], k: int) -> List[MicroBatch]:
    """Padded micro-batches stacked ``k`` at a time for the no-grad pre-pass (fewer, larger
    forwards). Packed micro-batches are already sized by the token budget: kept as they are;
    so is a list whose last group would be ragged (the schedule wants uniform shapes)."""
    if k <= 1 or "cu_seqlens" in microbatches[0]:
        return microbatches
    fused = [_stack(microbatches[i : i + k]) for i in range(0, len(microbatches), k)]
    if len({tuple(mb["tokens"].shape) for mb in fused}) > 1:
        return microbatches
    return fused


def _stack(mbs: List[MicroBatch]) -> MicroBatch:
    """Padded micro-batches stacked along the batch dimension (same sequence length); their
    response tensors are stacked too, ``index`` shifted to the stacked grid."""
    if len(mbs) == 1:
        return mbs[0]
    keys = ("tokens", "targets") + (("routed_experts",) if "routed_experts" in mbs[0] else ())
    out = {k: torch.cat([mb[k] for mb in mbs]) for k in keys}
    if "route_mode" in mbs[0]:
        out["route_mode"] = mbs[0]["route_mode"]
    longest = max(mb["response"]["mask"].shape[1] for mb in mbs)
    resp: Dict[str, torch.Tensor] = {}
    offset = 0
    for mb in mbs:
        for key, v in mb["response"].items():
            if v.dim() == 2:
                v = torch.nn.functional.pad(v, (0, longest - v.shape[1]))
                v = v + offset if key == "index" else v
            resp.setdefault(key, []).append(v)
        offset += mb["tokens"].numel()
    out["response"] = {key: torch.cat(v) for key, v in resp.items()}
    return out
