"""Our tiny CPU recipe against Hugging Face TRL's GRPOTrainer, side by side, per RL step.

Same model (the tiny base's HF checkpoint for TRL, its Megatron checkpoint for us), same prompts,
32 prompts x 8 completions of at most 5 new tokens per step, one optimizer step per generation
batch, the same AdamW settings, 2 threads each. TRL: token-mean loss (``loss_type="dapo"``),
beta = 0, fp32, no gradient checkpointing, generation by ``transformers.generate``
(``benchmarks/peer_trl_run.py``). Ours: ``recipes/tiny_cpu.yaml`` as shipped (P3O with its ESS
pre-pass, bf16 rollouts from the embedded engine) unless ``--set`` says otherwise.

TRL runs in a venv of its own (``--venv``, made on first use from
``benchmarks/peer_trl_requirements.txt`` with ``-c constraints-cpu.txt``: torch stays the pinned
CPU build). Runs alternate ours / TRL ``--reps`` times; the first ``--warmup`` steps of each run
are dropped, a run's time is its median step, and each side's best run is reported.

    python benchmarks/bench_peer_trl.py [--steps 20 --reps 3 --trl-micro 32 --set k=v ...]
                                        [--before DIR]

``--before DIR``: another checkout of this project (e.g. ``git worktree add DIR <commit>``, the
code before a change) runs the same recipe in the same loop, interleaved (ours, before, TRL per
rep), so a change's cost shows as ``before`` against ``ours`` and both against TRL in one run.

Phases. TRL: ``generate`` is the time inside ``_generate_and_score_completions`` (tokenising,
generate, decoding, reward, advantages); ``train`` the rest of the optimizer step. Ours:
``generate`` is ``rollout_s`` (generation, decoding, reward); ``train`` is compose + advantage +
train (ESS pre-pass, forward/backward, optimizer) + weight sync.

Last line: ``RESULT ours_vs_trl_step=<x> ours_vs_trl_generate=<g> ours_vs_trl_train=<t>``.
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


def _trl_python(venv: Path) -> str:
    py = venv / "bin" / "python"
    if not py.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        pins = ["-c", str(ROOT / "constraints-cpu.txt")]
        reqs = ["-r", str(ROOT / "benchmarks" / "peer_trl_requirements.txt")]
        subprocess.run([str(py), "-m", "pip", "install", "-q", *pins, *reqs], check=True)
    probe = "import torch; print(torch.__version__)"
    out = subprocess.run([str(py), "-c", probe], capture_output=True, text=True, check=True)
    torch_v = out.stdout.strip()
    if torch_v != "2.13.0+cpu":  # a CUDA build ("2.13.0+cu12x") would also start with 2.13.0
        sys.exit(f"{venv}: torch {torch_v} is not the pinned CPU build (remove the venv)")
    return str(py)


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
    ap.add_argument("--trl-micro", type=int, default=32, help="TRL completions per micro-batch")
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--set", action="append", default=[], help="key=value for our recipe")
    ap.add_argument("--before", help="another checkout of this project, run interleaved")
    args = ap.parse_args()

    from rich.console import Console
    from rich.table import Table

    console = Console()
    base = Path(args.base)
    if not (base / "hf" / "config.json").exists():
        console.print(f"making the tiny base in {base} (tools/make_tiny_base.py) ...")
        make = [sys.executable, str(ROOT / "tools" / "make_tiny_base.py"), "--out", str(base)]
        subprocess.run(make, check=True, env=_env(), cwd=ROOT)
    py = _trl_python(Path(args.venv))
    runs = {"ours": [], **({"before": []} if args.before else {}), "trl": []}
    with tempfile.TemporaryDirectory(prefix="bench-trl-") as tmp:
        for rep in range(args.reps):
            for side in runs:
                work = Path(tmp) / f"{side}{rep}"
                work.mkdir()
                console.print(f"rep {rep + 1}/{args.reps}: {side} ({args.steps} steps)")
                if side == "ours":
                    rows = _ours(base, work, args.steps, 1 + rep, args.set)
                elif side == "before":
                    before = Path(args.before).resolve()
                    rows = _ours(base, work, args.steps, 1 + rep, args.set, root=before)
                else:
                    rows = _trl(py, base, work, args.steps, 1 + rep, args.trl_micro, args.lr)
                runs[side].append(_summary(rows, args.warmup))
    best = {side: min(r, key=lambda s: s["step_s"]) for side, r in runs.items()}
    table = Table(title="per RL step, best run's median (seconds)")
    for col in ("", "step", "generate", "train", "completion tokens", "reward (last 5)"):
        table.add_column(col, justify="right")
    for side, s in best.items():
        table.add_row(side, f"{s['step_s']:.4f}", f"{s['generate_s']:.4f}", f"{s['train_s']:.4f}",
                      f"{s['tokens']:.0f}", f"{s['reward_last5']:.3f}")  # fmt: skip
    console.print(table)
    o, t = best["ours"], best["trl"]
    extra = ""
    if "before" in best:
        b = best["before"]
        extra = (
            f" before_vs_trl_step={b['step_s'] / t['step_s']:.2f}"
            f" ours_vs_before_step={o['step_s'] / b['step_s']:.3f}"
        )
    print(
        f"RESULT ours_vs_trl_step={o['step_s'] / t['step_s']:.2f} "
        f"ours_vs_trl_generate={o['generate_s'] / t['generate_s']:.2f} "
        f"ours_vs_trl_train={o['train_s'] / t['train_s']:.2f}" + extra
    )


if __name__ == "__main__":
    main()
