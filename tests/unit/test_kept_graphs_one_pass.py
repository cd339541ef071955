"""The memory side and the host reads of e_B without a second forward (issue 55).

- :func:`~megatron_p3o.update.step_memory.kept_graph_bytes` against what a kept-graph step
  really holds on this CPU: the tensors autograd saves (``saved_tensors_hooks``, unique
  storages) and the peak of the step's allocations (the profiler's memory timeline), for a
  grouped-query and a multi-head model, packed and padded;
- its attention windows are the local attention's;
- the kept-graph pass reads the host once per step (e_B), as the pre-pass did;
- ``batch.keep_graphs`` is checked where it is set.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from megatron_p3o.runtime.errors import ConfigError
from megatron_p3o.runtime.parallel import Layout

SEQ = 32
TINY = str(Path(__file__).resolve().parents[2] / "recipes" / "tiny_cpu.yaml")


def _samples(n: int, vocab: int, seed: int = 3):
    from megatron_p3o.types import Sample

    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        p = int(torch.randint(3, 9, (1,), generator=g))
        c = int(torch.randint(1, SEQ - p + 1, (1,), generator=g))
        ids = torch.randint(1, vocab, (p + c,), generator=g).tolist()
        lb = (-math.log(vocab) + 0.3 * torch.randn(c, generator=g)).tolist()
        out.append(Sample(ids[:p], ids[p:], lb, "stop", 0, group_id=i // 4))
    return out, torch.randn(n, generator=g).tolist()


def _setup(groups, kv_heads: int, vocab: int, packed: bool, keep_logits: str = "never"):
    from megatron_p3o.loss import build_objective
    from megatron_p3o.model.builder import BuildOptions, build_model
    from megatron_p3o.model.description import ModelDescription
    from megatron_p3o.update.batching import BatchConfig, MicroBatcher
    from megatron_p3o.update.optim import OptimConfig, wrap_ddp, zero_grads
    from megatron_p3o.update.policy_update import PolicyUpdate

    desc = ModelDescription(
        architecture="LlamaForCausalLM", vocab_size=vocab, hidden_size=64, intermediate_size=96,
        num_layers=2, num_heads=4, num_kv_heads=kv_heads, head_dim=16,
    )  # fmt: skip
    chunks = build_model(desc, groups, BuildOptions(seq_length=SEQ, fused_logprob=True))
    ddp = wrap_ddp(chunks, groups, OptimConfig())
    zero_grads(ddp)
    samples, adv = _samples(48, vocab)
    cfg = BatchConfig(max_tokens_per_gpu=256 if packed else None, micro_batch_size=8)
    (mbs,), _ = MicroBatcher(cfg, groups, SEQ, 0).build(samples, adv)
    update = PolicyUpdate(build_objective("p3o"), groups, vocab, keep_graphs="always",
                          keep_logits=keep_logits)  # fmt: skip
    return ddp, mbs, update


def kept_memory(groups, kv_heads: int, vocab: int, packed: bool, keep_logits: str = "never"):
    """(estimate, saved bytes, estimate without the transient and the kept logits (which ride
    on the kernel's ctx, not as saved tensors), peak allocation, micro-batches) of one
    kept-graph step on this rank (rank body)."""
    from torch.profiler import ProfilerActivity, profile

    from megatron_p3o.logprob import fused
    from megatron_p3o.update import kept_graphs, step_memory

    ddp, mbs, update = _setup(groups, kv_heads, vocab, packed, keep_logits)
    update.run(ddp, mbs)  # warm (lazily built state)
    shape = step_memory.model_shape(ddp[0], groups)
    need = step_memory.step_need(ddp, mbs, groups, vocab)
    kept = 0.0
    if keep_logits == "auto":
        assert need.logits_fit(True)
        kept = need.logits
    fused._KEPT.free.clear()  # the measured step allocates its kept logits
    estimate = step_memory.kept_graph_bytes(shape, mbs, groups.device) + kept
    assert estimate == need.graphs + kept  # the plan's own figure
    transient = shape.transient(max(int(mb["tokens"].numel()) for mb in mbs), groups.device)
    params = {p.untyped_storage().data_ptr() for p in ddp[0].parameters()}
    params |= {p.main_grad.untyped_storage().data_ptr() for p in ddp[0].parameters()}
    saved: dict = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in params:
            saved[s.data_ptr()] = s.nbytes()
        return t

    from megatron.core.pipeline_parallel import schedules

    fwd = schedules.forward_step

    def recording(*a, **k):
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            return fwd(*a, **k)

    schedules.forward_step = recording
    try:
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True,
                     with_stack=True) as prof:  # fmt: skip
            update.run(ddp, mbs)
    finally:
        schedules.forward_step = fwd
    assert kept_graphs.layout_refuses(ddp, groups) is None
    peak = step_memory.profiled_tensor_peak(prof)
    return estimate, sum(saved.values()), estimate - transient - kept, peak, len(mbs)


@pytest.mark.parametrize("kv_heads,vocab,packed,keep_logits", [
    (2, 300, True, "never"), (4, 300, True, "never"), (2, 20000, True, "never"),
    (2, 300, False, "never"), (2, 20000, True, "auto")])  # fmt: skip
def test_kept_graph_estimate_matches_the_measured_step(pools, kv_heads, vocab, packed,
                                                       keep_logits):  # fmt: skip
    """With ``keep_logits`` the fused kernel's kept logits (here 20,000 columns: most of the
    step's memory) join the estimate and the measured peak."""
    est, saved, graphs, peak, n = pools(1).run(
        kept_memory, Layout(), kv_heads=kv_heads, vocab=vocab, packed=packed,
        keep_logits=keep_logits,
    )[0]  # fmt: skip
    assert n >= 2
    assert abs(graphs / saved - 1) < 0.03, (graphs, saved)  # the saved tensors, per token
    assert abs(est / peak - 1) < 0.10, (est, peak)  # the bound: within 10%


def test_pack_windows_are_the_local_attention_windows():
    from megatron_p3o.model.local_attention import PACK_WINDOW, _window_plan
    from megatron_p3o.update.step_memory import pack_windows

    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        lens = torch.randint(1, 90, (int(torch.randint(1, 30, (1,), generator=g)),), generator=g)
        cu = [0] + torch.cumsum(lens, 0).tolist()
        plan = _window_plan(tuple(cu), torch.device("cpu"), PACK_WINDOW)
        want = [hi - lo for lo, hi, mask in plan if mask is not None]
        assert pack_windows(cu, PACK_WINDOW) == want
        # every token in exactly one window, none over the window unless alone
        assert plan[0][0] == 0 and plan[-1][1] == cu[-1]
        assert all(a[1] == b[0] for a, b in zip(plan, plan[1:]))
        assert all(hi - lo <= PACK_WINDOW for lo, hi, m in plan if m is not None)


def kept_pass_syncs(groups):
    """Host reads of the whole kept-graph pass (its forwards, e_B, backwards), device copies
    made distinct from the host micro-batches as in ``test_host_syncs`` (rank body)."""
    from megatron_p3o.model import forward
    from megatron_p3o.update import kept_graphs
    from tests.unit.test_host_syncs import SyncCounter, distinct_copies

    ddp, mbs, update = _setup(groups, 2, 300, True)
    counter = SyncCounter()
    counter.exempt = {id(v) for mb in mbs for v in mb.values() if torch.is_tensor(v)}
    orig_dev, orig_pass = forward.to_device, kept_graphs.mcore_compat.forwards_then_backwards

    to_device = distinct_copies(orig_dev)

    def counted(*a, **k):
        counter.active = True
        try:
            return orig_pass(*a, **k)
        finally:
            counter.active = False

    forward.to_device = to_device
    kept_graphs.mcore_compat.forwards_then_backwards = counted
    try:
        with counter.patched():
            update.run(ddp, mbs)
    finally:
        forward.to_device = orig_dev
        kept_graphs.mcore_compat.forwards_then_backwards = orig_pass
    return counter.count, counter.sites, len(mbs)


def test_the_kept_pass_reads_the_host_once(pools):
    count, sites, n = pools(1).run(kept_pass_syncs, Layout())[0]
    assert n >= 2
    assert count == 1, "\n".join(sites)  # e_B of the step, as the pre-pass reads it


def test_keep_graphs_is_checked_where_it_is_set():
    from megatron_p3o.config.loading import load_config
    from megatron_p3o.update.batching import BatchConfig

    with pytest.raises(ConfigError, match="batch.keep_graphs='sometimes'"):
        BatchConfig(keep_graphs="sometimes")
    cfg = load_config(TINY, ["batch.keep_graphs=never"])
    assert cfg.batch.keep_graphs == "never"
    assert load_config(TINY, []).batch.keep_graphs == "auto"


def nonfinite_messages(groups):
    """The error a NaN ℓθ raises through the pre-pass and through the kept graphs (rank body):
    NaN in one output-layer row makes every log-prob NaN."""
    from megatron_p3o.loss import NonFiniteLogprobError

    out = []
    for keep in ("never", "always"):
        ddp, mbs, update = _setup(groups, 2, 300, True)
        update.keep_graphs = keep
        with torch.no_grad():
            dict(ddp[0].module.named_parameters())["output_layer.weight"][3] = float("nan")
        try:
            update.run(ddp, mbs)
            out.append(None)
        except NonFiniteLogprobError as e:
            out.append(str(e))
    untouched = all(not p.main_grad.any() for p in ddp[0].parameters())
    return out, untouched


def test_a_nonfinite_logprob_stops_the_kept_pass_before_any_backward(pools):
    (prepass, kept), untouched = pools(1).run(nonfinite_messages, Layout())[0]
    assert prepass is not None and kept == prepass, (prepass, kept)
    assert untouched  # no micro-batch's backward ran
