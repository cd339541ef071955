"""Every parallel layout computes the same logits, loss and gradients as TP=1 on one process.

Reference: ``bodies.reference`` (a TP=1 GPTModel called directly, float64 log-softmax loss,
``loss.backward()``). Layouts run through Megatron's schedules, DDP and finalize_model_grads.
"""

import pytest
import torch

from megatron_p3o.model.packed import cp_chunk_positions
from megatron_p3o.runtime.parallel import Layout

from . import bodies

REL_TOL = 1e-5


def _assemble(results, family, n_micro, dp):
    """Full ``[B, S, V]`` logits and ``[B, S]`` log-probs from the last-stage ranks' shards."""
    vocab = bodies.FAMILIES[family]["vocab_size"]
    B, S = bodies.BATCH, bodies.SEQ
    per, mb = B // dp, B // dp // n_micro
    shards = [r for r in results if r["last"]]
    tp = 1 + max(r["tp_rank"] for r in shards)
    cp = 1 + max(r["cp_rank"] for r in shards)
    v_local = shards[0]["outs"][0]["logits"].shape[-1]
    logits = torch.full((B, S, v_local * tp), float("nan"))
    lp = torch.full((B, S), float("nan"))
    for r in shards:
        pos = cp_chunk_positions(S // cp, r["cp_rank"], cp) if cp > 1 else torch.arange(S)
        for i, out in enumerate(r["outs"]):
            rows = slice(r["dp_rank"] * per + i * mb, r["dp_rank"] * per + (i + 1) * mb)
            cols = slice(r["tp_rank"] * v_local, (r["tp_rank"] + 1) * v_local)
            logits[rows][:, pos, cols] = out["logits"]
            block = logits[rows]
            block[:, pos, cols] = out["logits"]
            logits[rows] = block
            lpb = lp[rows]
            lpb[:, pos] = out["lp"]
            lp[rows] = lpb
    return logits[..., :vocab], lp


CASES = [
    # (world, layout, micro-batches)
    (2, Layout(tp=2), 1),
    (2, Layout(pp=2), 2),
    (2, Layout(cp=2), 1),
    (2, Layout(dp=2), 2),
    (4, Layout(tp=2, pp=2), 2),
    (4, Layout(tp=2, cp=2), 1),
]


def _check(pools, tmp_path, init_ckpts, family, world, layout, n_micro):
    init = init_ckpts(family)
    grads = str(tmp_path / "grads")
    res = pools(world).run(
        bodies.layout_grads, layout, family=family, init=init, out=grads, n_micro=n_micro
    )
    ref = pools(2).run(bodies.reference, Layout(), family=family, init=init, compare_dirs=[grads])[
        0
    ]
    dp = world // (layout.tp * layout.pp * layout.cp)
    logits, lp = _assemble(res, family, n_micro, dp)
    assert not torch.isnan(logits).any(), "some logits were never produced"
    rel = (logits - ref["logits"]).norm() / ref["logits"].norm()
    assert rel < REL_TOL, f"logits differ: rel {rel:.3e}"
    mask = bodies.make_batch(family)["loss_mask"]
    loss = float(-(lp * mask).sum() / mask.sum())
    assert abs(loss - ref["loss"]) / abs(ref["loss"]) < REL_TOL, (loss, ref["loss"])
    errs = ref["errors"][grads]
    assert len(errs) == len(ref["grad_norms"])
    assert all(n > 0 for n in ref["grad_norms"].values()), "a reference gradient is zero"
    bad = {n: e for n, e in errs.items() if not e < REL_TOL}
    assert not bad, f"{layout}: parameter gradients differ from TP=1: {bad}"


@pytest.mark.distributed
@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize(
    "world,layout,n_micro",
    CASES,
    ids=lambda x: str(x) if not isinstance(x, Layout) else f"tp{x.tp}pp{x.pp}cp{x.cp}",
)
def test_layout_matches_tp1(pools, tmp_path, init_ckpts, family, world, layout, n_micro):
    _check(pools, tmp_path, init_ckpts, family, world, layout, n_micro)


@pytest.mark.distributed
def test_qkv_bias_family_tp2(pools, tmp_path, init_ckpts):
    _check(pools, tmp_path, init_ckpts, "qwen2", 2, Layout(tp=2), 2)


@pytest.mark.distributed
def test_interleaved_pipeline_matches_tp1(pools, tmp_path, init_ckpts):
    """PP=2 × VPP=2 (4 layers, 4 micro-batches); gloo needs batch_p2p_comm=False for this."""
    _check(pools, tmp_path, init_ckpts, "llama4l", 2, Layout(pp=2, vpp=2), 4)


@pytest.mark.distributed
@pytest.mark.parametrize(
    "family,world,layout,distributed,tol",
    [
        ("llama", 2, Layout(dp=2), False, 1e-5),
        ("llama", 2, Layout(dp=2), True, 1e-5),
        # TP splits the matmuls' sums, and Adam's m/√v magnifies the rounding where a gradient
        # is small against its √v: parameters within 10% of one lr=1e-3 step
        ("llama", 2, Layout(tp=2), False, 1e-4),  # TP replicas (norm weights) counted once
        ("qwen3", 2, Layout(pp=2), False, 1e-4),  # tied embedding on both stages counted once
    ],
    ids=["dp2-adam", "dp2-dist-adam", "tp2-adam", "pp2-tied-adam"],
)
def test_optimizer_matches_adamw(
    pools, tmp_path, init_ckpts, family, world, layout, distributed, tol
):
    """Megatron's optimizer steps at a layout = torch AdamW on one process: parameters, the
    gradient norm before clipping, and the update size ‖Δθ‖ / ‖θ‖ that ``UpdateSize`` measures
    (against float64 norms of the reference's own parameter differences)."""
    init = init_ckpts(family)
    out = str(tmp_path / "trained")
    got = pools(world).run(
        bodies.optimizer_steps,
        layout,
        family=family,
        init=init,
        out=out,
        distributed=distributed,
    )
    ref = pools(2).run(bodies.reference_adamw, Layout(), family=family, init=init, trained=out)[0]
    for a, b in zip(got[0]["norms"], ref["norms"]):
        assert abs(a - b) / b < 1e-5, (got[0]["norms"], ref["norms"])
    assert ref["norms"][0] > 1.0, "clipping should be active in this test"
    for r in got:  # every rank reports the same, global, numbers
        for mine, want in zip(r["sizes"], ref["sizes"]):
            for k in ("update_norm", "param_norm"):
                assert abs(mine[k] - want[k]) / want[k] < 1e-4, (k, r["sizes"], ref["sizes"])
            assert mine["update_rel"] == mine["update_norm"] / mine["param_norm"]
    bad = {n: e for n, e in ref["errors"].items() if not e < tol}
    assert not bad, f"parameters after AdamW steps differ: {bad}"


@pytest.mark.distributed
def test_dist_checkpoint_tp1_to_tp2_round_trip(pools, tmp_path, init_ckpts):
    init = init_ckpts("qwen3")
    tp2 = str(tmp_path / "tp2")
    pools(2).run(bodies.resave, Layout(tp=2), family="qwen3", src=init, out=tp2)
    same = pools(2).run(bodies.compare_checkpoints, Layout(), family="qwen3", a=init, b=tp2)[0]
    assert same and all(same.values()), {n: s for n, s in same.items() if not s}


@pytest.mark.distributed
@pytest.mark.parametrize(
    "kwargs,needle",
    [
        (dict(tp=3), "world size 2 is not divisible by tp×pp×cp = 3×1×1 = 3"),
        (dict(tp=2, dp=2), "dp=2 but world size 2 / (tp×pp×cp = 2) = 1"),
    ],
)
def test_impossible_layout_message(pools, kwargs, needle):
    msgs = pools(2).run(bodies.try_layout, None, **kwargs)
    assert all(m is not None and needle in m for m in msgs), msgs
