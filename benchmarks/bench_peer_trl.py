"""Our tiny CPU recipe against Hugging Face TRL's GRPOTrainer, side by side, per RL step, on
equal micro-batches.

Same model (the tiny base's HF checkpoint for TRL, its Megatron checkpoint for us), same prompts,
32 prompts x 8 completions of at most 5 new tokens per step, one optimizer step per generation
batch, the same AdamW settings, 2 threads each. TRL: token-mean loss (``loss_type="dapo"``),
beta = 0, fp32, no gradient checkpointing, generation by ``transformers.generate``
(``benchmarks/peer_trl_run.py``). Ours: ``recipes/tiny_cpu.yaml`` as shipped (P3O, e_B from the
gradient pass's forwards when the step's graphs fit, bf16 rollouts from the embedded engine)
unless ``--set`` says otherwise.

Equal micro-batches (``--budgets``): ours at ``batch.max_tokens_per_gpu`` = B tokens, TRL at
B / 16 completions per micro-batch (prompt + completion ≤ 16 tokens, padded to the longest):
512 tokens against 32 completions (the recipe's budget), 4096 against 256 (the whole step in
one micro-batch). The CPU model is printed first.

TRL runs in a venv of its own (``--venv``, made on first use from
``benchmarks/peer_trl_requirements.txt`` with ``-c constraints-cpu.txt``: torch stays the pinned
CPU build). Runs alternate ours / TRL ``--reps`` times; the first ``--warmup`` steps of each run
are dropped, a run's time is its median step, and each side's best run is reported.

    python benchmarks/bench_peer_trl.py [--steps 20 --reps 3 --budgets 512,4096 --set k=v ...]
                                        [--before DIR]

``--before DIR``: another checkout of this project (e.g. ``git worktree add DIR <commit>``, the
code before a change) runs the same recipe in the same loop, interleaved (ours, before, TRL per
rep and budget), so a change's cost shows as ``before`` against ``ours`` and both against TRL in
one run.

Phases. TRL: ``generate`` is the time inside ``_generate_and_score_completions`` (tokenising,
generate, decoding, reward, advantages); ``train`` the rest of the optimizer step. Ours:
``generate`` is ``rollout_s`` (generation, decoding, reward); ``train`` is compose + advantage +
train (ESS pre-pass, forward/backward, optimizer) + weight sync.

Last line: ``RESULT ours_vs_trl_step_<B>=<x> ours_vs_trl_step_paired_<B>=<p>
ours_vs_trl_generate_<B>=<g> ours_vs_trl_train_<B>=<t>`` for every budget B (``paired``: the
median over reps of ours / TRL within a rep: same seed, run one after the other), and
``before_vs_trl_step_<B>``, ``ours_vs_before_step_<B>`` with ``--before``; the spread over reps
is printed with the table, the per-rep ratios below it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))


def _env() -> dict:
    threads = os.environ.get("OMP_NUM_THREADS", "2")
    return {**os.environ, "OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads,
            "TOKENIZERS_PARALLELISM": "false"}  # fmt: skip


def _ours(base: Path, work: Path, steps: int, seed: int, sets, root: Path = ROOT) -> list:
    """Our recipe from the checkout ``root`` (``python -m`` there imports that checkout's code)."""
    cmd = [sys.executable, "-m", "megatron_p3o.train", str(root / "recipes" / "tiny_cpu.yaml")]
    for kv in (f"model.checkpoint={base / 'ckpt'}", f"data.path={base / 'train.jsonl'}",
               f"data.eval_path={base / 'heldout.jsonl'}", f"run.dir={work}", f"steps={steps}",
               "data.eval_every=0", f"run.seed={seed}", *sets):  # fmt: skip
        cmd += ["--set", kv]
    r = subprocess.run(cmd, capture_output=True, text=True, env=_env(), cwd=root)
    if r.returncode:
        sys.exit(f"our run ({root}) failed:\n{r.stderr[-2000:]}")
    rows = [json.loads(line) for line in open(next(work.glob("*/metrics.jsonl")))]
    out = []
    for m in rows:
        gen = m["rollout_s"]
        rest = m["compose_s"] + m["advantage_s"] + m["train_s"] + m["sync_s"]
        out.append({"step_s": gen + rest, "generate_s": gen, "train_s": rest,
                    "tokens": m["rollout_tokens"], "reward": m["reward_mean"]})  # fmt: skip
    return out


def _trl(py: str, base: Path, work: Path, steps: int, seed: int, micro: int, lr: float) -> list:
    out = work / "trl.jsonl"
    cmd = [py, str(ROOT / "benchmarks" / "peer_trl_run.py"), "--base", str(base),
           "--repo", str(ROOT), "--steps", str(steps), "--seed", str(seed),
           "--micro", str(micro), "--lr", str(lr),
           "--out", str(out), "--work", str(work / "trl")]  # fmt: skip
    r = subprocess.run(cmd, capture_output=True, text=True, env=_env(), cwd=ROOT)
    if r.returncode:
        sys.exit(f"TRL run failed:\n{r.stderr[-2000:]}")
    rows = [json.loads(line) for line in open(out)]
    return [{"step_s": m["step_s"], "generate_s": m["generate_s"],
             "train_s": m["step_s"] - m["generate_s"], "tokens": m.get("completion_tokens", 0),
             "reward": m.get("reward", float("nan"))} for m in rows]  # fmt: skip


def _summary(rows: list, warmup: int) -> dict:
    rows = rows[warmup:]
    med = {k: statistics.median(r[k] for r in rows) for k in ("step_s", "generate_s", "train_s")}
    med["tokens"] = statistics.mean(r["tokens"] for r in rows)
    med["reward_last5"] = statistics.mean(r["reward"] for r in rows[-5:])
    return med


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", default=str(ROOT / "runs" / "tiny_base"))
    ap.add_argument("--venv", default=str(ROOT / ".venv-bench-trl"))
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument(
        "--budgets",
        default="512,4096",
        help="our token budgets per micro-batch; TRL gets budget/16 completions",
    )
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--set", action="append", default=[], help="key=value for our recipe")
    ap.add_argument("--before", help="another checkout of this project, run interleaved")
    args = ap.parse_args()

    from machine import cpu_model
    from machine import trl_python as _trl_python
    from rich.console import Console
    from rich.table import Table

    console = Console(width=140)
    console.print(f"CPU: {cpu_model()}, {_env()['OMP_NUM_THREADS']} threads per run")
    base = Path(args.base)
    if not (base / "hf" / "config.json").exists():
        console.print(f"making the tiny base in {base} (tools/make_tiny_base.py) ...")
        make = [sys.executable, str(ROOT / "tools" / "make_tiny_base.py"), "--out", str(base)]
        subprocess.run(make, check=True, env=_env(), cwd=ROOT)
    py = _trl_python(Path(args.venv))
    budgets = [int(b) for b in args.budgets.split(",")]
    sides = ["ours", *(["before"] if args.before else []), "trl"]
    runs = {(side, b): [] for b in budgets for side in sides}
    with tempfile.TemporaryDirectory(prefix="bench-trl-") as tmp:
        for rep in range(args.reps):
            for b in budgets:
                for side in sides:
                    work = Path(tmp) / f"{side}{rep}_{b}"
                    work.mkdir()
                    console.print(f"rep {rep + 1}/{args.reps}, {b} tokens: {side} "
                                  f"({args.steps} steps)")  # fmt: skip
                    sets = [*args.set, f"batch.max_tokens_per_gpu={b}"]
                    if side == "ours":
                        rows = _ours(base, work, args.steps, 1 + rep, sets)
                    elif side == "before":
                        before = Path(args.before).resolve()
                        rows = _ours(base, work, args.steps, 1 + rep, sets, root=before)
                    else:
                        rows = _trl(py, base, work, args.steps, 1 + rep, b // 16, args.lr)
                    runs[(side, b)].append(_summary(rows, args.warmup))
    best = {k: min(r, key=lambda s: s["step_s"]) for k, r in runs.items()}
    table = Table(title="per RL step, best run's median (seconds); spread: every rep's median")
    for col in ("", "budget", "step", "spread", "generate", "train", "completion tokens",
                "reward (last 5)"):  # fmt: skip
        table.add_column(col, justify="right")
    for (side, b), s in best.items():
        spread = "–".join(
            f"{x['step_s']:.3f}" for x in sorted(runs[(side, b)], key=lambda x: x["step_s"])
        )
        micro = f"{b} tok" if side != "trl" else f"{b // 16} compl"
        nums = [f"{s[k]:.4f}" for k in ("step_s", "generate_s", "train_s")]
        table.add_row(side, micro, nums[0], spread, *nums[1:], f"{s['tokens']:.0f}",
                      f"{s['reward_last5']:.3f}")  # fmt: skip
    console.print(table)
    parts = []
    for b in budgets:
        o, t = best[("ours", b)], best[("trl", b)]
        # rep by rep: the same seed, run next to each other (a slow spell hits both)
        paired = [x["step_s"] / y["step_s"] for x, y in zip(runs[("ours", b)], runs[("trl", b)])]
        console.print(f"ours / TRL per step at {b} tokens, rep by rep: "
                      + ", ".join(f"{x:.2f}" for x in paired)
                      + f" (median {statistics.median(paired):.2f})")  # fmt: skip
        parts += [f"ours_vs_trl_step_{b}={o['step_s'] / t['step_s']:.2f}",
                  f"ours_vs_trl_step_paired_{b}={statistics.median(paired):.2f}",
                  f"ours_vs_trl_generate_{b}={o['generate_s'] / t['generate_s']:.2f}",
                  f"ours_vs_trl_train_{b}={o['train_s'] / t['train_s']:.2f}"]  # fmt: skip
        if args.before:
            bf = best[("before", b)]
            parts += [f"before_vs_trl_step_{b}={bf['step_s'] / t['step_s']:.2f}",
                      f"ours_vs_before_step_{b}={o['step_s'] / bf['step_s']:.3f}"]  # fmt: skip
    print("RESULT " + " ".join(parts))


if __name__ == "__main__":
    main()
