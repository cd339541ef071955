"""Where a training step's time goes: the tiny recipe's step, phase by phase, beside TRL 1.16's
GRPOTrainer on the same work with equal micro-batches, per micro-batch budget.

Ours: ``recipes/tiny_cpu.yaml`` (P3O, bf16 rollouts from the embedded engine) at
``batch.max_tokens_per_gpu`` = each budget, in-process, one variant per fresh process:
``keep`` (``batch.keep_graphs: auto``: e_B from the gradient pass's own forwards when the
step's graphs fit) and ``prepass`` (``never``: the ESS pre-pass, one no-grad forward more).
TRL: ``benchmarks/peer_trl_run.py --profile`` at budget / 16 completions per micro-batch
(prompt + completion ≤ 16 tokens: 32 completions are 512 tokens, 256 the whole step). Same
base, prompts, AdamW settings and threads (``OMP_NUM_THREADS``, default 2) as
``bench_peer_trl.py``. Runs alternate, round after round, so contention hits every variant
alike; a run's number per phase is the median over its measured steps, and each variant's best
round (lowest median step) is reported, with the spread over rounds.

Phases (exclusive wall-clock: the time between two events goes to the innermost open phase,
``phase_clock.py``; they add up to the step). Ours: rollout (generation, reward), packing
(micro-batches from samples), plan (the step's counts, one all-reduce, the memory verdict),
e_B pre-pass (its schedule, forwards and log-probs), forward (the model), log-probs + loss
(ℓθ kernel, objective, device metrics), backward, finalize grads (DP all-reduce), schedule
Python (Megatron's schedule and ours around it), metrics read (the step's one reduction and
host read), optimizer (clip + Adam), zero grads, weight sync, logging, trainer Python (compose,
advantages, the rest). Counts per step: micro-batches, the CPU shim's calls (and their cost at
the calibrated per-call price, inside the other phases), tensor→host reads inside the update.
TRL: rollout, forward (its model with the lm head and log-softmax), loss, backward, optimizer
(clip + AdamW), zero grads, trainer Python.

    python benchmarks/bench_step_profile.py [--budgets 512,4096 --steps 12 --warmup 3
                                             --rounds 2 --no-trl --before DIR --set key=value]

``--before DIR``: another checkout (e.g. ``git worktree add DIR <commit>``, the code before a
change) profiled in the same rounds as variant ``before``.
    python benchmarks/bench_step_profile.py --memory   # kept graphs: estimate vs measured peak

``--memory``: one kept-graph step of the tiny recipe (``batch.keep_graphs: always``) at each
budget; the peak of the step's tensor allocations (the profiler's memory timeline: every
allocation and free, in order) against :func:`~megatron_p3o.update.step_memory.kept_graph_bytes`
of the same micro-batches; the resident high-water mark (VmHWM) above the step's start in an
unprofiled step (the allocator reuses memory freed earlier: a floor, not the tensors' peak);
and the dry run's figure for the recipe (every sequence ``model.seq_length`` long: an upper
bound).
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
if "--root" in sys.argv:  # a worker for another checkout (``--before``): its code, not ours
    sys.path.insert(0, sys.argv[sys.argv.index("--root") + 1])
else:
    sys.path.insert(0, str(ROOT))

OURS = ("rollout", "packing", "plan", "e_B pre-pass", "forward", "log-probs + loss", "backward",
        "finalize grads", "schedule python", "metrics read", "optimizer", "zero grads",
        "weight sync", "logging", "trainer python")  # fmt: skip
TRL = ("rollout", "forward", "loss", "backward", "optimizer", "zero grads", "trainer python")


def env() -> dict:
    threads = os.environ.get("OMP_NUM_THREADS", "2")
    return {**os.environ, "OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads,
            "MKL_DYNAMIC": "FALSE", "TOKENIZERS_PARALLELISM": "false",
            "PYTHONWARNINGS": "ignore"}  # fmt: skip


def recipe_sets(base: Path, work: Path, steps: int, budget: int, keep: str, sets) -> list:
    return [f"model.checkpoint={base / 'ckpt'}", f"data.path={base / 'train.jsonl'}",
            f"data.eval_path={base / 'heldout.jsonl'}", f"run.dir={work}", f"steps={steps}",
            "data.eval_every=0", "checkpoint.every=0", f"batch.max_tokens_per_gpu={budget}",
            *([f"batch.keep_graphs={keep}"] if keep else []), *sets]  # fmt: skip


def build_trainer(base: Path, work: Path, steps: int, budget: int, keep: str, sets):
    import torch

    from megatron_p3o.config.loading import load_config
    from megatron_p3o.loop import start_groups
    from megatron_p3o.trainer import Trainer

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
    sets = recipe_sets(base, work, steps, budget, keep, sets)
    cfg = load_config(str(ROOT / "recipes" / "tiny_cpu.yaml"), sets).with_task_files()
    trainer = Trainer(cfg, start_groups(cfg))
    if keep:  # the variant, whatever the trainer passed (an older checkout has no such knob)
        trainer.update.keep_graphs = cfg.batch.keep_graphs
    return trainer


def shim_call_seconds() -> float:
    """The CPU shim's cost per call: a factory through its wrapper against the bare factory."""
    import time

    import torch

    bare = getattr(torch.empty, "__wrapped__", None)
    if bare is None:
        return 0.0
    n = 20000
    t0 = time.perf_counter()
    for _ in range(n):
        torch.empty(0)
    t1 = time.perf_counter()
    for _ in range(n):
        bare(0)
    t2 = time.perf_counter()
    return max((t1 - t0) - (t2 - t1), 0.0) / n


def instrument(trainer):
    """Wrap the step's functions in a PhaseClock; returns it and the host-read counter."""
    import torch
    from megatron.core.pipeline_parallel import schedules
    from phase_clock import PhaseClock

    from megatron_p3o import trainer as trainer_mod
    from megatron_p3o.model import forward as forward_mod

    clock = PhaseClock()
    pre = "e_B pre-pass"

    def named(plain):
        return lambda stack: pre if pre in stack else plain

    upd = trainer.update

    def wrap(owner, attr, name):  # an older checkout may lack some of them
        if hasattr(owner, attr):
            clock.wrap(owner, attr, name)

    wrap(trainer.rollout, "next_batch", "rollout")
    wrap(trainer.batcher, "build", "packing")
    wrap(upd, "run", "schedule python")
    wrap(upd, "_check_inputs", "plan")
    wrap(upd, "plan", "plan")
    wrap(upd, "ess_before_gradients", pre)
    wrap(upd, "micro_loss", "log-probs + loss")
    wrap(upd, "finalise", "metrics read")
    wrap(trainer.chunks[0], "forward", named("forward"))
    wrap(forward_mod, "_call_loss", named("log-probs + loss"))
    wrap(schedules, "backward_step", "backward")
    cfg = trainer.chunks[0].config
    wrap(cfg, "finalize_model_grads_func", "finalize grads")
    wrap(trainer.opt, "step", "optimizer")
    wrap(trainer_mod, "zero_grads", "zero grads")
    wrap(trainer.rollout, "publish", "weight sync")
    wrap(trainer, "_log", "logging")
    reads = {"n": 0, "on": False}
    # what would wait for a device (``numpy()`` is not among them: a device tensor refuses it,
    # and on the host it is a view, e.g. the attention masks written in place)
    for name in ("item", "tolist", "__float__", "__int__", "__bool__", "cpu"):
        orig = getattr(torch.Tensor, name)

        def counted(self, *a, _orig=orig, **k):
            if reads["on"]:
                reads["n"] += 1
            return _orig(self, *a, **k)

        setattr(torch.Tensor, name, counted)
    run = upd.run

    def counting_run(*a, **k):
        reads["on"] = True
        try:
            return run(*a, **k)
        finally:
            reads["on"] = False

    upd.run = counting_run
    return clock, reads


def ours_worker(a) -> None:
    from megatron_p3o.runtime import cpu_shim

    with tempfile.TemporaryDirectory(prefix="step-profile-") as tmp:
        trainer = build_trainer(Path(a.base), Path(tmp), a.steps, a.budget, a.keep, a.set)
        try:
            per_call = shim_call_seconds()
            clock, reads = instrument(trainer)
            for i in range(a.steps):
                clock.take()
                calls0, reads["n"] = cpu_shim.CALLS, 0
                clock.push("trainer python")
                m = trainer.step()
                clock.pop()
                phases = clock.take()
                calls = cpu_shim.CALLS - calls0
                row = {"step": i, "step_s": sum(phases.values()), "phases": phases,
                       "micro": m.get("microbatches_per_rank", 0.0), "shim_calls": calls,
                       "shim_s": calls * per_call, "host_reads": reads["n"],
                       "tokens": m.get("n_tokens", 0.0)}  # fmt: skip
                print(json.dumps(row), flush=True)
        finally:
            trainer.close()


def memory_worker(a) -> None:
    """One kept-graph step measured twice: its resident high-water mark (VmHWM) above the
    step's start, unprofiled; then the peak of its tensor allocations (the profiler's memory
    timeline), against the estimate for the same micro-batches."""
    import torch
    from memory import peak_mb, reset_peak, rss_mb
    from torch.profiler import ProfilerActivity, profile

    from megatron_p3o.update import step_memory

    try:  # the fused kernel's pool of kept-logits memory (an older checkout has none)
        from megatron_p3o.logprob.fused import _KEPT
    except ImportError:
        _KEPT = None

    with tempfile.TemporaryDirectory(prefix="step-memory-") as tmp:
        trainer = build_trainer(Path(a.base), Path(tmp), 6, a.budget, "always", a.set)
        try:
            for _ in range(2):  # warm: allocator, kernels, lazily built state
                trainer.step()
            seen = {}
            run = trainer.update.run

            def rss(chunks, mbs, *rest, **k):
                before = rss_mb()
                reset_peak()
                out = run(chunks, mbs, *rest, **k)
                seen["rss_peak"] = (peak_mb() - before) * 2**20
                return out

            def allocations(chunks, mbs, *rest, **k):
                need = step_memory.step_need(chunks, mbs, trainer.groups, trainer.update.vocab_size)
                # the kept graphs and, as the plan decides, the fused kernel's kept logits
                kept = trainer.update.keep_logits == "auto" and need.logits_fit(True)
                seen["estimate"] = need.graphs + (need.logits if kept else 0.0)
                seen["micro"] = len(mbs)
                seen["tokens"] = sum(int(mb["tokens"].numel()) for mb in mbs)
                if _KEPT is not None:  # kept logits allocated inside the measured step
                    _KEPT.free.clear()
                with profile(activities=[ProfilerActivity.CPU], profile_memory=True,
                             record_shapes=True, with_stack=True) as prof:  # fmt: skip
                    out = run(chunks, mbs, *rest, **k)
                seen["alloc_peak"] = step_memory.profiled_tensor_peak(prof)
                return out

            trainer.update.run = rss
            trainer.step()
            trainer.update.run = allocations
            torch.manual_seed(0)
            trainer.step()
            seen["plan"] = plan_figure(a.budget, a.set)
            print(json.dumps(seen), flush=True)
        finally:
            trainer.close()


def plan_figure(budget: int, sets) -> float:
    """The dry run's kept-graph figure for the recipe at ``budget`` (local attention, every
    sequence ``model.seq_length`` long), bytes; 0 where a step is one micro-batch per rank."""
    from megatron_p3o.config.loading import load_config
    from megatron_p3o.config.plan import describe_model, make_plan

    sets = [f"batch.max_tokens_per_gpu={budget}", "model.use_te=false", *sets]
    cfg = load_config(str(ROOT / "recipes" / "tiny_cpu.yaml"), sets)
    desc, div = describe_model(cfg)
    gib = make_plan(cfg, 1, desc, div).kept_graphs_gib
    return (gib or 0.0) * 2**30


def run_ours(base, budget, keep, steps, sets, memory=False, root=None) -> list:
    cmd = [sys.executable, __file__, "--worker", "memory" if memory else "ours", "--base",
           str(base), "--budget", str(budget), "--keep", keep, "--steps", str(steps)]  # fmt: skip
    if root is not None:
        cmd += ["--root", str(root)]
    for kv in sets:
        cmd += ["--set", kv]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env(), cwd=root or ROOT)
    if r.returncode:
        sys.exit(f"our run failed:\n{r.stderr[-3000:]}")
    return [json.loads(x) for x in r.stdout.splitlines() if x.startswith("{")]


def run_trl(py, base, micro, steps, work: Path) -> list:
    out = work / "trl.jsonl"
    cmd = [py, str(ROOT / "benchmarks" / "peer_trl_run.py"), "--base", str(base), "--repo",
           str(ROOT), "--steps", str(steps), "--seed", "1", "--micro", str(micro), "--out",
           str(out), "--work", str(work / "trl"), "--profile"]  # fmt: skip
    r = subprocess.run(cmd, capture_output=True, text=True, env=env(), cwd=ROOT)
    if r.returncode:
        sys.exit(f"TRL run failed:\n{r.stderr[-3000:]}")
    return [json.loads(x) for x in out.read_text().splitlines()]


def summary(rows: list, warmup: int) -> dict:
    rows = rows[warmup:]
    phases = sorted({k for r in rows for k in r["phases"]})
    out = {"step_s": statistics.median(r["step_s"] for r in rows)}
    out["phases"] = {k: statistics.median(r["phases"].get(k, 0.0) for r in rows) for k in phases}
    for k in ("micro", "shim_calls", "shim_s", "host_reads"):
        if k in rows[0]:
            out[k] = statistics.median(r[k] for r in rows)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", default=str(ROOT / "runs" / "tiny_base"))
    ap.add_argument("--venv", default=str(ROOT / ".venv-bench-trl"))
    ap.add_argument("--budgets", default="512,4096")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--variants", default="keep,prepass")
    ap.add_argument("--no-trl", action="store_true")
    ap.add_argument("--memory", action="store_true")
    ap.add_argument("--before", help="another checkout, profiled as variant 'before'")
    ap.add_argument("--root", help=argparse.SUPPRESS)
    ap.add_argument("--set", action="append", default=[], help="key=value for our recipe")
    ap.add_argument("--worker", choices=("ours", "memory"))
    ap.add_argument("--budget", type=int, default=512)
    ap.add_argument("--keep", default="auto")
    a = ap.parse_args()
    if a.worker == "ours":
        return ours_worker(a)
    if a.worker == "memory":
        return memory_worker(a)
    from machine import cpu_model

    budgets = [int(x) for x in a.budgets.split(",")]
    print(f"CPU: {cpu_model()}, {os.environ.get('OMP_NUM_THREADS', '2')} threads")
    if a.memory:
        return memory_main(a, budgets)
    from machine import trl_python as _trl_python

    py = None if a.no_trl else _trl_python(Path(a.venv))
    keep = {"keep": "auto", "prepass": "never", "before": ""}
    variants = [v for v in a.variants.split(",") if v] + (["before"] if a.before else [])
    runs: dict = {}
    with tempfile.TemporaryDirectory(prefix="step-profile-") as tmp:
        for rnd in range(a.rounds):
            for b in budgets:
                for v in variants:
                    print(f"round {rnd + 1}/{a.rounds}: ours {v} at {b} tokens", flush=True)
                    root = Path(a.before).resolve() if v == "before" else None
                    rows = run_ours(a.base, b, keep[v], a.steps, a.set, root=root)
                    runs.setdefault((v, b), []).append(summary(rows, a.warmup))
                if py:
                    micro = max(1, b // 16)
                    print(f"round {rnd + 1}/{a.rounds}: TRL at {micro} completions", flush=True)
                    work = Path(tmp) / f"trl{rnd}_{b}"
                    work.mkdir()
                    rows = run_trl(py, a.base, micro, a.steps, work)
                    runs.setdefault(("trl", b), []).append(summary(rows, a.warmup))
    report(runs, budgets, variants, bool(py))


def report(runs: dict, budgets, variants, with_trl: bool) -> None:
    from rich.console import Console
    from rich.table import Table

    con = Console(width=120)
    for b in budgets:
        cols = [(v, b) for v in variants] + ([("trl", b)] if with_trl else [])
        best = {c: min(runs[c], key=lambda s: s["step_s"]) for c in cols}
        t = Table(title=f"ms per step at {b} tokens per micro-batch (TRL: {max(1, b // 16)} "
                  "completions); the best round's medians")  # fmt: skip
        t.add_column("phase")
        for c in cols:
            t.add_column(f"{c[0]}", justify="right")
        names = list(OURS) + [n for n in TRL if n not in OURS]
        for n in names:
            vals = [best[c]["phases"].get(n) for c in cols]
            if any(v for v in vals):
                t.add_row(n, *[f"{1e3 * v:.1f}" if v else "" for v in vals])
        t.add_row("step", *[f"{1e3 * best[c]['step_s']:.1f}" for c in cols])
        spread = [sorted(1e3 * s["step_s"] for s in runs[c]) for c in cols]
        t.add_row("rounds", *["–".join(f"{x:.0f}" for x in sp) for sp in spread])
        for k, fmt in (("micro", "{:.1f}"), ("shim_calls", "{:.0f}"), ("shim_s", "{:.2f}"),
                       ("host_reads", "{:.0f}")):  # fmt: skip
            vals = [best[c].get(k) for c in cols]
            if any(v is not None for v in vals):
                scale = 1e3 if k == "shim_s" else 1
                label = {"micro": "micro-batches", "shim_calls": "CPU shim calls",
                         "shim_s": "CPU shim ms (in the phases)",
                         "host_reads": "host reads (update)"}[k]  # fmt: skip
                t.add_row(label, *["" if v is None else fmt.format(v * scale) for v in vals])
        con.print(t)
        if with_trl:
            trl = best[("trl", b)]["step_s"]
            ratios = [f"{v}_vs_trl_step_{b}={best[(v, b)]['step_s'] / trl:.2f}" for v in variants]
            print("RESULT " + " ".join(ratios))


def memory_main(a, budgets) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title="one kept-graph step of the tiny recipe: estimate vs measured (MiB)")
    for c in ("budget", "micro-batches", "tokens", "estimate", "tensor peak", "est / peak",
              "RSS peak", "dry run (full-length)"):  # fmt: skip
        t.add_column(c, justify="right")
    worst = 0.0
    for b in budgets:
        r = run_ours(a.base, b, "always", 4, a.set, memory=True)[-1]
        ratio = r["estimate"] / max(r["alloc_peak"], 1)
        worst = max(worst, abs(ratio - 1))
        plan = f"{r['plan'] / 2**20:.2f}" if r["plan"] else "(one micro-batch)"
        t.add_row(str(b), str(r["micro"]), str(r["tokens"]), f"{r['estimate'] / 2**20:.2f}",
                  f"{r['alloc_peak'] / 2**20:.2f}", f"{ratio:.3f}",
                  f"{r['rss_peak'] / 2**20:.2f}", plan)  # fmt: skip
    Console(width=130).print(t)
    print(f"RESULT kept_graph_estimate_max_rel_error={worst:.3f}")


if __name__ == "__main__":
    main()
