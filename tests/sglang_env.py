"""The SGLang environment's interpreter for the tests that run it (the real-server tier and the
unit tests that read SGLang's own code): ``$SGLANG_PYTHON``, else ``.venv-sglang``.

``tools/run_tests.sh`` starts the suite while it still builds that environment (the slowest
install) and names the file its exit status will be written to (``$P3O_SGLANG_ENV_RC``, its
log ``$P3O_SGLANG_ENV_LOG``): :func:`sglang_python` waits for it and fails with the build's log
if the build failed. Without the environment these tests fail rather than skip: a tier that
silently skips proves nothing.
"""

import os
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def wait_for_the_environment(timeout_s: float = 1800) -> None:
    """Block until ``tools/run_tests.sh``'s SGLang build has ended (no-op outside it); fail with
    the build's log if it failed or did not end within ``timeout_s``."""
    rc_file = os.environ.get("P3O_SGLANG_ENV_RC")
    if not rc_file:
        return
    log = Path(os.environ.get("P3O_SGLANG_ENV_LOG", ""))
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(rc_file):
        if time.monotonic() > deadline:
            pytest.fail(f"the SGLang environment was not built within {timeout_s:.0f}s ({log})",
                        pytrace=False)  # fmt: skip
        time.sleep(2)
    rc = Path(rc_file).read_text().strip()
    if rc != "0":
        lines = log.read_text(errors="replace").splitlines(True)[-20:] if log.is_file() else []
        pytest.fail(f"tools/sglang_env.sh failed (exit {rc}; {log}):\n{''.join(lines)}",
                    pytrace=False)  # fmt: skip


def interpreter_path() -> str:
    """Where the interpreter is expected: ``$SGLANG_PYTHON``, else ``.venv-sglang``."""
    return os.environ.get("SGLANG_PYTHON") or str(ROOT / ".venv-sglang/bin/python")


def sglang_python() -> str:
    """The interpreter, once the environment is built; a clear failure where there is none."""
    wait_for_the_environment()
    py = interpreter_path()
    if not os.access(py, os.X_OK):
        pytest.fail(
            f"no SGLang environment at {py}: run `bash tools/sglang_env.sh` and export "
            "SGLANG_PYTHON (tools/run_tests.sh does both)",
            pytrace=False,
        )
    return py
