"""Mismatch probe: ``python -m megatron_p3o.probe RECIPE.yaml [--prompts N] [--out DIR]``.

Measures, at the recipe's checkpoint (``model.checkpoint``) and on its held-out prompts
(``data.eval_path``, else ``data.path``), the trainer against the recipe's rollout engine — the
embedded engine at any precision, or an SGLang server (``rollout.sglang.url``, or launched from
``rollout.sglang.model_path``): one completion per prompt from the engine, scored by the trainer
at the same weights. Writes ``probe.json`` and ``probe.png`` to ``--out`` (default
``runs/<run.name>/probe/``): per-token |Δℓ| (mean, p50, p99, by completion position), per-sequence
|ΣΔℓ|, KL(πb‖πθ), the ESS e_B and the ρ = πθ/πb histogram, every token's ℓθ and ℓb, and the stress
studies' verdict (:mod:`megatron_p3o.stress.verdicts`: the v5 study's levels, v3's for the engines
v5 did not run) — only against levels of the engine's own kind of mismatch on the shipped base
the studies ran; otherwise "not studied".

Builds the trainer as ``megatron_p3o.train`` does (one process, or torchrun) but never trains and
never writes a checkpoint; the trainer's scratch run directory is ``OUT/trainer/`` (its
config.json and, when it launched one, the SGLang server's log). ``--set key=value`` as in train.
"""

from __future__ import annotations

import argparse
import os

# As in megatron_p3o.train: a fixed MKL thread count keeps one command bitwise reproducible.
os.environ.setdefault("MKL_DYNAMIC", "FALSE")

PROG = "megatron_p3o.probe"
SCRATCH = "trainer"  # OUT/trainer: the trainer's run directory (logs only, no checkpoint)


def main(argv=None) -> int:
    from megatron_p3o.runtime.errors import count_arg

    ap = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    ap.add_argument("recipe")
    ap.add_argument("--prompts", type=count_arg, default=64, help="held-out prompts (default 64)")
    ap.add_argument("--out", help="output directory (default runs/<run.name>/probe)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--debug", action="store_true", help="show the traceback of user errors too")
    a = ap.parse_args(argv)
    from dataclasses import replace
    from pathlib import Path

    from megatron_p3o.config.loading import load_config

    cfg = load_config(a.recipe, a.set).with_task_files()
    out = Path(a.out) if a.out else Path(cfg.run.dir) / cfg.run.name / "probe"
    _check_out(out)
    # the trainer's run directory: scratch under OUT (never resumes, never checkpoints), no W&B
    cfg = replace(
        cfg,
        run=replace(cfg.run, dir=str(out), name=SCRATCH),
        wandb=replace(cfg.wandb, enabled=False),
    )
    from rich.console import Console

    from megatron_p3o.loop import start_groups

    groups = start_groups(cfg)
    con = Console(quiet=groups.rank != 0, soft_wrap=True, stderr=False)
    report = probe(cfg, groups, a.prompts, con)
    report["recipe"] = str(a.recipe)
    report["overrides"] = list(a.set)
    if groups.rank == 0:
        write(report, out)
        con.print(summary_table(report))
        con.print(report["verdict"]["summary"], markup=False)
        con.print(f"wrote {out / 'probe.json'} and {out / 'probe.png'}")
    return 0


def _check_out(out) -> None:
    from megatron_p3o.runtime.errors import InputFileError

    if out.exists() and not out.is_dir():
        raise InputFileError(f"--out {out} is a file, not a directory")


def engine_of(cfg) -> dict:
    """The rollout engine the recipe names, in words and keys (for probe.json)."""
    r = cfg.rollout
    d = {"engine": r.engine}
    if r.engine == "embedded":
        d["precision"] = r.precision
        d["fp8_kv_cache"] = r.fp8_kv_cache
        d["name"] = f"embedded {r.precision}" + (" + fp8 KV" if r.fp8_kv_cache else "")
    else:
        s = r.sglang
        url = getattr(s, "url", None)
        d.update(
            url=url,
            launched=not url,
            model_path=getattr(s, "model_path", None),
            dtype=getattr(s, "dtype", None),
            quantization=getattr(s, "quantization", None),
        )
        d["name"] = f"SGLang {'at ' + url if url else 'launched'} ({d['dtype']})"
    for k in ("logit_noise", "engine_temperature", "weight_rounding_step"):
        v = getattr(r, k)
        if v:
            d[k] = v
    d["trainer_dtype"] = cfg.model.params_dtype
    return d


def probe(cfg, groups, n_prompts: int, con) -> dict:
    """Build the trainer (model from ``model.checkpoint``, the rollout backend from
    ``rollout.*``), probe it, close it; returns the report (identical on every rank)."""
    from rich.markup import escape
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    from megatron_p3o.stress.probe import mismatch_stats, probe_detail
    from megatron_p3o.stress.verdicts import engine_kind, studied_task, verdict
    from megatron_p3o.trainer import Trainer

    engine = engine_of(cfg)
    words = {
        "sample": f"sampling one completion per prompt from the {engine['name']} engine"
        + (" (multi-turn: through the turn loop)" if cfg.rollout.multi_turn else ""),
        "score": f"scoring them with the trainer ({cfg.model.params_dtype})",
        "gather": "gathering every rank's tokens",
    }
    cols = (SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn())
    with Progress(*cols, console=con, disable=con.quiet, transient=False) as bar:
        task = bar.add_task(
            escape(
                f"building the trainer from {cfg.model.checkpoint} and the {engine['name']} engine"
                + (" (launching the server)" if engine.get("launched") else "")
            ),
            total=1,
        )
        current = [task]

        def phase(name: str) -> None:
            bar.update(current[0], completed=1)
            current[0] = bar.add_task(escape(words[name]), total=1)

        trainer = Trainer(cfg, groups)
        try:
            if trainer.resumed_from is not None:  # cannot happen: the scratch dir is fresh
                raise RuntimeError(f"the probe's scratch run resumed {trainer.resumed_from}")
            basic, tokens = probe_detail(trainer, n_prompts, on_phase=phase)
        finally:
            trainer.close()
        bar.update(current[0], completed=1)
    if not tokens.logp_theta:
        from megatron_p3o.runtime.errors import DataError

        raise DataError(f"probe: the engine's {tokens.prompts} completions have no tokens to score")
    stats = mismatch_stats(tokens)
    v = verdict(stats["per_token"]["mean_abs_dlogp"], stats["per_sequence"]["mean_abs_sum_dlogp"],
                engine_kind(engine), studied_task(cfg.model.checkpoint))  # fmt: skip
    return {
        "checkpoint": str(cfg.model.checkpoint),
        "rollout": engine,
        "prompts": {"path": tokens.path, "requested": n_prompts, "used": tokens.prompts},
        **stats,
        "stress_probe": basic,
        "verdict": v,
        "tokens_detail": {
            "logp_theta": tokens.logp_theta,
            "logp_behavior": tokens.logp_behavior,
            "position": tokens.position,
            "sequence": tokens.sequence,
        },
    }


def write(report: dict, out) -> None:
    import json

    out.mkdir(parents=True, exist_ok=True)
    tmp = out / "probe.json.tmp"
    tmp.write_text(json.dumps(report, indent=1))
    tmp.replace(out / "probe.json")
    plot(report, out / "probe.png")


def plot(report: dict, path) -> None:
    """|Δℓ| by completion position (mean, with the p50 and p99 bands) and the ρ histogram."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    floor = 1e-12  # log axes: an exact match (|Δℓ| = 0) is drawn at the floor
    pos = report["by_position"]
    x = [p["position"] for p in pos]
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4))
    if pos:
        p50 = [max(p["p50"], floor) for p in pos]
        p99 = [max(p["p99"], floor) for p in pos]
        ax.fill_between(x, floor, p50, alpha=0.35, color="C0", label="≤ p50")
        ax.fill_between(x, p50, p99, alpha=0.15, color="C0", label="p50–p99")
        ax.plot(x, [max(p["mean"], floor) for p in pos], "o-", color="C1", label="mean")
        lo = min([*p50, max(min(p["mean"] for p in pos), floor)])
        ax.set_ylim(max(lo / 10, floor), max(p99) * 3)
    ax.set_yscale("log")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("completion position")
    ax.set_ylabel("|ℓθ − ℓb|")
    ax.set_title(f"per-token |Δℓ| by position ({report['tokens']} tokens)")
    ax.legend(loc="best", fontsize=8)
    h = report["rho_histogram"]
    edges, counts = h["log_rho_edges"], h["counts"]
    widths = [b - a for a, b in zip(edges, edges[1:])]
    bx.bar(edges[:-1], counts, width=widths, align="edge", color="C2", edgecolor="k", lw=0.3)
    bx.set_yscale("log")
    bx.set_xlabel("log ρ = ℓθ − ℓb")
    bx.set_ylabel("tokens")
    bx.set_title(f"ρ = πθ/πb: e_B = {report['ess']:.6f}, KL(πb‖πθ) = {report['kl_b_theta']:.2e}")
    fig.suptitle(
        f"{report['rollout']['name']} vs trainer {report['rollout']['trainer_dtype']}: "
        f"mean |Δℓ| {report['per_token']['mean_abs_dlogp']:.3g}, "
        f"|ΣΔℓ| {report['per_sequence']['mean_abs_sum_dlogp']:.3g}"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def summary_table(report: dict):
    from rich.table import Table

    r = report
    t = Table(title=f"mismatch probe: {r['rollout']['name']} vs the trainer "
              f"({r['rollout']['trainer_dtype']}), {r['prompts']['used']} prompts, "
              f"{r['tokens']} tokens")  # fmt: skip
    for c in ("statistic", "mean", "p50", "p99"):
        t.add_column(c)
    pt, ps = r["per_token"], r["per_sequence"]
    t.add_row("per-token |ℓθ − ℓb|", f"{pt['mean_abs_dlogp']:.3e}", f"{pt['p50_abs_dlogp']:.3e}",
              f"{pt['p99_abs_dlogp']:.3e}")  # fmt: skip
    t.add_row("per-sequence |Σ(ℓθ − ℓb)|", f"{ps['mean_abs_sum_dlogp']:.3e}",
              f"{ps['p50_abs_sum_dlogp']:.3e}", f"{ps['p99_abs_sum_dlogp']:.3e}")  # fmt: skip
    t.add_row("KL(πb‖πθ) per token", f"{r['kl_b_theta']:.3e}", "", "")
    t.add_row("ESS e_B", f"{r['ess']:.6f}", "", "")
    return t


if __name__ == "__main__":
    from megatron_p3o.runtime.errors import run_cli

    run_cli(main, PROG)
