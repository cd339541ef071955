"""Graceful stop: end the run after the current optimizer step, with a checkpoint of that step.

Why: clusters preempt jobs and end them at their time limit with a signal some seconds before
SIGKILL; without this, everything since the last periodic checkpoint is lost. Three triggers,
any of them on any rank:

- a signal in ``run.exit_signals`` (default SIGTERM, SIGUSR1) to a trainer process: its handler
  only records it, so a second signal during the save changes nothing (and the save is atomic);
- ``run.exit_after_minutes`` of wall clock since the start;
- a file ``STOP`` in the run directory (what ``tools/slurm/p3o.sbatch`` writes when Slurm signals
  the batch shell: no signal has to pass through srun and torchrun, whose agent would SIGKILL
  its workers 30 s after forwarding one). While it exists a started run exits at once, so
  torchrun's restarts do not resume training; the batch script removes it when the requeued job
  starts.

Every rank must stop at the same step: once per step the ranks' reasons are all-reduced (max)
over a gloo group of this module's own. The run then exits with :data:`EXIT_PREEMPTED`; the same
command resumes from the checkpoint.
"""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path
from typing import Optional, Sequence

import torch

from megatron_p3o.runtime.collectives import all_max

EXIT_PREEMPTED = 75  # EX_TEMPFAIL: stopped on request after a checkpoint; rerun to resume
STOP_FILE = "STOP"
_REASONS = {1: "signal", 2: "run.exit_after_minutes", 3: STOP_FILE}
_SIGNALLED = threading.Event()  # a stop signal arrived: work that can be abandoned stops


def signalled() -> bool:
    """Whether a stop signal reached this process (a multi-turn rollout polls this and stops
    its trajectories, killing their tools: :class:`RolloutInterrupted`)."""
    return _SIGNALLED.is_set()


class RolloutInterrupted(Exception):
    """A rollout abandoned because a stop signal arrived; the run checkpoints its last finished
    step and exits, and the resumed run makes this batch again."""


class GracefulStop:
    """Collects stop requests; :meth:`agreed` tells every rank the same answer."""

    def __init__(
        self,
        signals: Sequence[str],
        exit_after_minutes: Optional[float],
        run_dir: Path,
        group,
        is_rank0: bool,
    ):
        self.run_dir, self.group, self.is_rank0 = Path(run_dir), group, is_rank0
        self.deadline = (
            None if exit_after_minutes is None else time.monotonic() + 60.0 * exit_after_minutes
        )
        self.signal: Optional[str] = None
        _SIGNALLED.clear()
        self._old = {}
        for name in signals:
            sig = getattr(signal, name)
            self._old[sig] = signal.signal(sig, self._record)

    def _record(self, signum, frame) -> None:
        self.signal = self.signal or signal.Signals(signum).name
        _SIGNALLED.set()

    @property
    def stop_file(self) -> Path:
        return self.run_dir / STOP_FILE

    def _local(self) -> int:
        if self.signal is not None:
            return 1
        if self.deadline is not None and time.monotonic() >= self.deadline:
            return 2
        if self.is_rank0 and self.stop_file.exists():
            return 3
        return 0

    def agreed(self) -> Optional[str]:
        """The reason to stop now (the same on every rank), or None. A collective."""
        code = torch.tensor([self._local()], dtype=torch.int64)
        all_max(code, self.group, "every rank stops after the same step if any was asked to")
        c = int(code.item())  # host tensor: no device sync
        if c == 0:
            return None
        return self.signal if c == 1 and self.signal else _REASONS[c]

    def close(self) -> None:
        _SIGNALLED.clear()
        for sig, old in self._old.items():
            signal.signal(sig, old)
        self._old = {}
