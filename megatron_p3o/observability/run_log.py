"""Where a run's numbers go: metrics.jsonl, TensorBoard and (optionally) Weights & Biases.

Why one module: every scalar the trainer reports reaches every sink under the same name, on
global rank 0 only. W&B is an optional extra (``pip install .[wandb]``), imported lazily and off
by default; ``mode: offline`` needs no network (``wandb sync`` uploads later) and is what the
tests use. The W&B run id is kept in the run directory, so the same command after a checkpoint
resume continues the same W&B run. Histograms (the per-step log-ratio histogram) go to W&B as
histograms; lists are kept out of TensorBoard.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Literal, Optional

from megatron_p3o.runtime.errors import UserError, one_line


@dataclass(frozen=True)
class WandbConfig:
    """Attributes:
    enabled: log to W&B as well (needs the ``wandb`` extra).
    mode: "online", "offline" (files under ``dir``; ``wandb sync`` later) or "disabled".
    project / entity / group / name / tags: the W&B run's identity (name defaults to
        ``run.name``; a stress grid sets group = the grid's name, name = the cell).
    dir: where W&B writes its files (default: the run directory).
    """

    enabled: bool = False
    mode: Literal["online", "offline", "disabled"] = "online"
    project: str = "megatron-p3o"
    entity: Optional[str] = None
    group: Optional[str] = None
    name: Optional[str] = None
    tags: List[str] = field(default_factory=list)
    dir: str = ""


TB_FLUSH_SECS = 5


class RunLog:
    """Rank 0's sinks; on other ranks every call is a no-op."""

    def __init__(
        self, run_dir: Path, config: dict, wandb: WandbConfig, active: bool, resumed: bool
    ):
        self.run_dir, self.active = run_dir, active
        self.tb = self.wb = None
        if not active:
            return
        from torch.utils.tensorboard import SummaryWriter

        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.json").write_text(json.dumps(config, indent=2))
        # TensorBoard's writer thread writes each record as it comes and flushes every
        # TB_FLUSH_SECS (and at close); a flush per step waited on that thread (~0.7 ms of a
        # tiny CPU step). metrics.jsonl, written and closed every step, is the record.
        self.tb = SummaryWriter(str(run_dir / "tensorboard"), flush_secs=TB_FLUSH_SECS)
        if wandb.enabled and wandb.mode != "disabled":
            self.wb = _start_wandb(run_dir, config, wandb, resumed)

    def rewind(self, step: int) -> int:
        """A run resumed at ``step`` after a crash (kill -9, a lost node) trains the steps after
        it again: their earlier records leave metrics.jsonl and eval.jsonl for
        ``<file>.rewound`` (kept, appended), so each step has one line. Returns how many moved."""
        if not self.active:
            return 0
        moved = 0
        for name in ("metrics.jsonl", "eval.jsonl"):
            path = self.run_dir / name
            if not path.is_file():
                continue
            lines = path.read_text().splitlines(keepends=True)
            keep = [x for x in lines if _step_of(x) <= step]
            if len(keep) == len(lines):
                continue
            with open(path.with_name(name + ".rewound"), "a") as f:
                f.writelines(x for x in lines if _step_of(x) > step)
            tmp = path.with_name(name + ".tmp")
            tmp.write_text("".join(keep))
            tmp.replace(path)
            moved += len(lines) - len(keep)
        return moved

    def log(self, step: int, metrics: Dict, prefix: str = "train/", jsonl: str = "") -> None:
        """One record: a line of ``jsonl`` (everything; default metrics.jsonl, one line per
        trainer step — evaluations go to eval.jsonl), scalars to TensorBoard and W&B,
        ``log_ratio_hist`` as a W&B histogram."""
        if not self.active:
            return
        lists = {k: v for k, v in metrics.items() if isinstance(v, list) and k.endswith("_lengths")}
        for k, v in lists.items():  # per-sample values: a TensorBoard histogram, not a line
            if v:
                self.tb.add_histogram(prefix + k, torch_tensor(v), step)
        metrics = {k: v for k, v in metrics.items() if k not in lists}
        record = {"step": step, **metrics}
        with open(self.run_dir / (jsonl or "metrics.jsonl"), "a") as f:
            f.write(json.dumps(record) + "\n")
        scalars = {
            (k if "/" in k else prefix + k): float(v)
            for k, v in metrics.items()
            if k != "step" and isinstance(v, (int, float))
        }
        from tensorboard.compat.proto.summary_pb2 import Summary

        # one event per record with every scalar of it (TensorBoard reads each value by its tag):
        # an event per scalar was ~4 ms of a tiny CPU step (60 scalars)
        summary = Summary(value=[Summary.Value(tag=k, simple_value=v) for k, v in scalars.items()])
        self.tb.file_writer.add_summary(summary, step)
        if self.wb is not None:
            payload = dict(scalars)
            hist = metrics.get("log_ratio_hist")
            if hist:
                payload[prefix + "log_ratio_hist"] = _wandb_hist(hist)
            self.wb.log(payload, step=step)

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
            self.tb = None
        if self.wb is not None:
            self.wb.finish()
            self.wb = None


def torch_tensor(values):
    import torch

    return torch.tensor(values, dtype=torch.float32)


def _step_of(line: str) -> float:
    """The ``step`` of one JSONL record; a torn last line (the crash cut it) counts as later."""
    try:
        return float(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return float("inf")


def _wandb_hist(counts: List[float]):
    import wandb

    from megatron_p3o.observability.metrics import COARSE_HIST_RANGE as r

    n = len(counts)  # metrics.jsonl's log_ratio_hist: n bins over log ρ ∈ [−r, r]
    edges = [-r + 2 * r * i / n for i in range(n + 1)]
    return wandb.Histogram(np_histogram=(counts, edges))


_NO_LOGIN = (
    "wandb.enabled=true with wandb.mode=online needs a W&B login: set WANDB_API_KEY (or run "
    "`wandb login`), or log offline with WANDB_MODE=offline or --set wandb.mode=offline "
    "(`wandb sync` uploads later)"
)


def wandb_mode(cfg: WandbConfig) -> str:
    """``$WANDB_MODE`` when set (W&B's own switch, e.g. ``WANDB_MODE=offline`` on a node
    without network), else ``wandb.mode``; wandb.init itself lets its argument win."""
    return os.environ.get("WANDB_MODE", "").strip() or cfg.mode


def check_wandb(cfg: WandbConfig) -> None:
    """At config time, before the model is built: W&B on needs the extra and, online, some
    credential. Only the certain cases are refused here (no key, no netrc, no identity token,
    no terminal to prompt on); :func:`_start_wandb` turns W&B's own refusal into one line."""
    if not cfg.enabled or wandb_mode(cfg) == "disabled":
        return
    import importlib.util

    if importlib.util.find_spec("wandb") is None:
        raise UserError("wandb.enabled=true needs the wandb extra: pip install -e '.[wandb]'")
    if wandb_mode(cfg) != "online" or sys.stdin.isatty():
        return
    if any(os.environ.get(k) for k in ("WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE")):
        return
    netrc = [os.environ.get("NETRC", ""), "~/.netrc", "~/_netrc"]
    if not any(p and Path(p).expanduser().is_file() for p in netrc):
        raise UserError(_NO_LOGIN)


def _start_wandb(run_dir: Path, config: dict, cfg: WandbConfig, resumed: bool):
    try:
        import wandb
    except ImportError:
        raise UserError(
            "wandb.enabled=true needs the wandb extra: pip install -e '.[wandb]'"
        ) from None
    id_file = run_dir / "wandb_id.txt"
    run_id = id_file.read_text().strip() if resumed and id_file.is_file() else None
    mode = wandb_mode(cfg)
    try:
        run = wandb.init(
            project=cfg.project,
            entity=cfg.entity,
            group=cfg.group,
            name=cfg.name or run_dir.name,
            tags=list(cfg.tags),
            dir=cfg.dir or str(run_dir),
            mode=mode,
            config=config,
            id=run_id,
            resume="allow" if run_id else None,
        )
    except (wandb.errors.UsageError, wandb.errors.AuthenticationError) as e:
        login = mode == "online" and not os.environ.get("WANDB_API_KEY")
        raise UserError(_NO_LOGIN if login else f"wandb.init ({mode}): {one_line(e)}") from None
    except wandb.errors.CommError as e:
        raise UserError(
            f"wandb.init could not reach W&B ({one_line(e)}); check the network or WANDB_API_KEY, "
            "or log offline with WANDB_MODE=offline or --set wandb.mode=offline"
        ) from None
    id_file.write_text(run.id)
    return run
