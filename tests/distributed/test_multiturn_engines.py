"""Multi-turn rollouts through the embedded engine, then the trainer (issue 53): the prefix
invariant holds over every turn, a re-tokenized history would not; on policy (fp32, no push)
the trainer's ℓθ equals the engine's ℓb on the policy's tokens, e_B = 1, and no gradient reaches
a logits row that scores an environment token. The real SGLang server:
tests/sglang_server/test_multiturn_real.py."""

import pytest

from megatron_p3o.runtime.parallel import Layout

from . import multiturn_bodies as mb


@pytest.fixture(scope="module")
def tool_ckpt(pools, tmp_path_factory):
    from megatron_p3o.data.tasks import tool_calc

    d = tmp_path_factory.mktemp("tool_model")
    tool_calc.make_tokenizer(d / "tok", tool_calc.splits(2000, 10)[0])
    out = d / "ckpt"
    pools(1).run(mb.tool_model, Layout(), tok_dir=str(d / "tok"), out=str(out))
    return str(out)


@pytest.mark.distributed
def test_embedded_multiturn_token_in_token_out_and_on_policy(pools, tool_ckpt):
    """The embedded engine's multi-turn server (one forward per tick for every trajectory, KV
    kept between turns), with a push landing mid-turn for some trajectories and during a tool
    call for others (ticks 4 and 15): 0 prefix violations over 51 episodes × 3 turns, each
    token versioned by the weights that sampled it, and on policy afterwards."""
    pushes = [(4, 1), (15, 2)]
    samples, inv = pools(1).run(mb.embedded_rollout, Layout(), ckpt=tool_ckpt, n_prompts=17,
                                pushes=pushes)[0]  # fmt: skip
    assert inv["episodes"] >= 50 and inv["turns"] >= 3 * 50, inv
    assert inv["violations"] == 0, inv
    assert inv["retokenized"] >= 1, inv  # the defect the loop avoids exists here
    assert all(s.meta["turns"] == 3 and s.meta["status"] == "completed" for s in samples)
    spans = [s.policy_versions() for s in samples]
    assert all(v == sorted(v) for v in spans)  # per token, in the order sampled
    assert {x for v in spans for x in v} == {0, 1, 2}
    assert any(len(set(v)) == 3 for v in spans)  # trajectories that straddle both pushes
    res = pools(1).run(mb.on_policy_step, Layout(), ckpt=tool_ckpt, samples=samples)[0]
    assert res["max_lp_diff"] < 1e-5, res
    assert abs(res["ess"] - 1.0) < 1e-6, res
    assert res["env_rows"] > 0 and res["env_grad_max"] == 0.0, res
    assert res["policy_rows"] > res["env_rows"] and res["policy_grad_min"] > 0.0, res
