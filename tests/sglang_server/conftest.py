"""The real SGLang server tier: where its interpreter is, and teardown by process group.

Every test here launches real SGLang 0.5.23 servers (on CPU: ``SGLANG_USE_CPU_ENGINE=1``) through
the trainer's own launch path. The SGLang environment comes from ``tools/sglang_env.sh``
(``$SGLANG_PYTHON``, else ``.venv-sglang``); without it these tests fail rather than skip — CI
installs it, and a tier that silently skips proves nothing.
"""

import os
import signal
from pathlib import Path

import pytest

from tests.sglang_env import sglang_python as sglang_env_python


@pytest.fixture(scope="session", autouse=True)
def sglang_python():
    py = sglang_env_python()
    os.environ["SGLANG_PYTHON"] = py
    return py


def kill_launched(where: Path) -> list:
    """SIGKILL the process group of every server/router whose pid file lies under ``where``
    (what a test's trainer launched and may have left behind); returns the groups killed."""
    killed = []
    for pid_file in Path(where).rglob("*.pid"):
        try:
            pgid = int(pid_file.read_text())
            os.killpg(pgid, signal.SIGKILL)
            killed.append(pgid)
        except (ValueError, ProcessLookupError, PermissionError):
            pass
    return killed


@pytest.fixture
def reap(tmp_path):
    """Teardown: whatever the test launched under ``tmp_path`` is stopped, also on failure."""
    yield tmp_path
    kill_launched(tmp_path)


def log_tail(where: Path, n: int = 30) -> str:
    """The last lines of every server log under ``where`` (for a failing test's message)."""
    out = []
    for log in sorted(Path(where).rglob("*.log")):
        lines = log.read_text(errors="replace").splitlines()[-n:]
        out.append(f"--- {log}\n" + "\n".join(lines))
    return "\n".join(out)
