import fcntl
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests.rank_pool import PoolRegistry  # noqa: E402

_POOLS = PoolRegistry()


@pytest.fixture(scope="session")
def pools():
    """``pools(n)`` -> a persistent :class:`RankPool` of n gloo ranks (shared by every test)."""
    yield _POOLS
    _POOLS.close()


# The tiers in the order they run: the long end-to-end and real-server files first, the many
# short files last (longest first leaves short files to even out the workers' ends).
# pytest-xdist (``--dist loadfile --no-loadscope-reorder``, tools/run_tests.sh) hands whole
# files to the workers in this order. Its default order (most tests per file first) starts with
# the unit files, three of which run code in the SGLang environment, which tools/run_tests.sh
# is still building when the suite starts (≈ 3 min more): here every test that needs it comes
# after the e2e tier (≈ 15 min of work on 2 workers).
TIER_ORDER = ("e2e", "sglang_server", "distributed", "unit", "gpu")


def pytest_collection_modifyitems(session, config, items):
    """Order the collected tests by tier (:data:`TIER_ORDER`), keeping each file's own order."""

    def tier(item) -> int:
        parts = item.path.relative_to(config.rootpath).parts
        name = parts[1] if len(parts) > 2 and parts[0] == "tests" else ""
        return TIER_ORDER.index(name) if name in TIER_ORDER else len(TIER_ORDER)

    items.sort(key=tier)  # stable: files stay whole, in collection order within a tier


def pytest_runtest_teardown(item, nextitem):
    """Close the rank pools once the next test does not use them (the tiers after the
    distributed one): idle ranks are not free. Megatron's groups leave ``gloo_tcp_loop`` threads
    behind that outlive ``destroy_process_group`` (measured: 66 per rank after the MoE tests,
    with no ProcessGroup object left in Python) and wake up on their own, ≈ 4–5% of a core per
    rank; a session's pools (ranks of worlds 1–4) held through the e2e and SGLang tiers cost
    them a large part of a core. A later test that needs a pool starts a fresh one."""
    if "pools" not in getattr(item, "fixturenames", ()):
        return
    if nextitem is None or (
        "pools" not in getattr(nextitem, "fixturenames", ())
        and nextitem.path.parent != item.path.parent
    ):
        _POOLS.close()


def built_once(tmp_path_factory, name: str, build) -> Path:
    """``build(out)`` run once per test run, also when pytest-xdist runs the files on several
    workers (each its own session, which would build every session fixture again: the
    ``trained_export`` run alone is ≈ 70 s). The first worker to ask builds it under an
    exclusive lock in the temporary directory all workers share (xdist's
    ``getbasetemp().parent``); the others wait for it and reuse the result. A build that fails
    leaves no ``.built`` mark, so the next worker to ask tries again (and fails as clearly)."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent
    out = root / f"shared-{name}"
    with open(root / f"shared-{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (out / ".built").exists():
            shutil.rmtree(out, ignore_errors=True)
            out.mkdir(parents=True)
            build(out)
            (out / ".built").write_text("")
    return out


@pytest.fixture(scope="session")
def base(tmp_path_factory):
    """The quickstart's own base model (the one shipped in ``bases/tiny_addition``, installed by
    ``tools/make_tiny_base.py`` in seconds: the same weights on every CPU), so the learning tests
    measure what a user gets (e2e and the SGLang tier)."""
    from tests.e2e.cli import ENV, ROOT

    made = os.environ.get("P3O_TEST_BASE")  # a developer's base made earlier (not in CI)
    if made:
        return Path(made)

    def build(d):
        r = subprocess.run(
            [sys.executable, str(ROOT / "tools/make_tiny_base.py"), "--out", str(d / "base")],
            capture_output=True,
            text=True,
            env=ENV,
            timeout=900,
        )
        assert r.returncode == 0, r.stderr[-3000:]

    out = built_once(tmp_path_factory, "base", build) / "base"
    assert json.loads((out / "base.json").read_text())["heldout_greedy_acc"] >= 0.4
    return out


def _shipped_base(tmp_path_factory, task: str, name: str):
    """``bases/<task>`` installed once per run by ``tools/make_base.py --task <task>``."""
    from tests.e2e.cli import ENV, ROOT

    def build(d):
        r = subprocess.run(
            [sys.executable, str(ROOT / "tools/make_base.py"), "--task", task, "--out",
             str(d / "base")], capture_output=True, text=True, env=ENV, timeout=900,
        )  # fmt: skip
        assert r.returncode == 0, r.stderr[-3000:]

    return built_once(tmp_path_factory, name, build) / "base"


@pytest.fixture(scope="session")
def tool_base(tmp_path_factory):
    """The multi-turn tool recipe's base (``bases/tool_calc``, installed in seconds): HF,
    Megatron, the task's splits."""
    return _shipped_base(tmp_path_factory, "tool_calc", "tool_base")


@pytest.fixture(scope="session")
def code_base(tmp_path_factory):
    """The agent recipe's base (``bases/tool_code``): HF, Megatron, the task's splits."""
    return _shipped_base(tmp_path_factory, "tool_code", "code_base")


@pytest.fixture(scope="session")
def moe_base(tmp_path_factory):
    """A tiny random Qwen3-MoE (4 experts, top-2) on the addition task: HF and Megatron."""
    from tests.e2e.cli import ENV, ROOT

    def build(d):
        out = d / "base"
        code = f"""
import sys, torch
sys.path.insert(0, {str(ROOT)!r})
from pathlib import Path
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
from megatron_p3o.data.tasks.arithmetic import make_tokenizer, splits, write_jsonl
out = Path({str(out)!r})
tok = make_tokenizer(out / "hf")
train, held = splits(seed=0)
write_jsonl(train, out / "train.jsonl")
write_jsonl(held[:64], out / "heldout.jsonl")
torch.manual_seed(0)
cfg = Qwen3MoeConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128,
    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, norm_topk_prob=True,
    max_position_embeddings=32, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
    pad_token_id=tok.pad_token_id, tie_word_embeddings=False)
Qwen3MoeForCausalLM(cfg).save_pretrained(out / "hf")
"""
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=ENV)
        assert r.returncode == 0, r.stderr[-3000:]
        r = subprocess.run(
            [sys.executable, "-m", "checkpoints_convert.hf_to_megatron", "--hf", str(out / "hf"),
             "--out", str(out / "ckpt")], capture_output=True, text=True, env=ENV, cwd=ROOT,
        )  # fmt: skip
        assert r.returncode == 0, r.stderr[-3000:]

    return built_once(tmp_path_factory, "moe", build) / "base"


@pytest.fixture(scope="session")
def trained_export(base, tmp_path_factory):
    """A checkpoint the trainer wrote (not the converter) at TP=2 × PP=2 (torchrun, 4 ranks,
    2 P3O steps) and its HF export by ``checkpoints_convert.megatron_to_hf --ckpt RUN_DIR``,
    run from outside the checkout: ``(run dir, export dir)``."""
    from tests.e2e.cli import ENV, ROOT, torchrun

    def build(d):
        sets = {
            "model.checkpoint": base / "ckpt", "data.path": base / "train.jsonl",
            "data.eval_path": base / "heldout.jsonl", "data.eval_every": 0, "steps": 2,
            "batch.prompts_per_rollout": 8, "run.dir": d, "run.name": "tp2pp2",
            "parallel.tp": 2, "parallel.pp": 2,
        }  # fmt: skip
        cmd = [*torchrun(4), "-m", "megatron_p3o.train", str(ROOT / "recipes/tiny_cpu.yaml")]
        for k, v in sets.items():
            cmd += ["--set", f"{k}={v}"]
        r = subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=900, cwd=d)
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
        r = subprocess.run(
            [sys.executable, "-m", "checkpoints_convert.megatron_to_hf", "--ckpt",
             str(d / "tp2pp2"), "--out", str(d / "hf")], capture_output=True, text=True, env=ENV,
            timeout=600, cwd=d,
        )  # fmt: skip
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
        assert json.loads(r.stdout[r.stdout.index("{") :])["checkpoint"].endswith("step_000002")

    d = built_once(tmp_path_factory, "trained", build)
    return d / "tp2pp2", d / "hf"
