"""The code tool's sandbox (issue 64): a snippet that loops forever, allocates without bound,
forks, writes outside its directory, opens a socket, or prints without end ends in its
documented outcome (megatron_p3o/env/sandbox.py) within its limits, and the next one runs."""

import asyncio
import os
import time

import pytest

from megatron_p3o.env.sandbox import Limits, run_python, run_python_sync

LIMITS = Limits(wall_s=6.0, cpu_s=1, memory_mb=128, files_mb=1, output_bytes=64)
CASES = {
    "print(sum(range(10)))": ("ok", "45"),
    "1/0": ("error", "ZeroDivisionError"),
    "while True: pass": ("cpu_limit", ""),
    "import signal\nsignal.signal(signal.SIGXCPU, signal.SIG_IGN)\nwhile True: pass": (
        "cpu_limit",
        "",
    ),
    "import time\ntime.sleep(60)": ("timeout", ""),
    "x = []\nwhile True: x.append(bytearray(10**7))": ("memory", "MemoryError"),
    "import os\nos.fork()": ("blocked", "os.fork is not allowed"),
    "import subprocess\nsubprocess.run(['true'])": ("blocked", "not allowed"),
    "import os\nos.system('true')": ("blocked", "os.system is not allowed"),
    "import socket\nsocket.create_connection(('127.0.0.1', 9))": ("blocked", "import socket"),
    "import urllib.request\nurllib.request.urlopen('http://127.0.0.1:9')": ("blocked", "socket"),
    "import ctypes": ("blocked", "import ctypes"),
    "while True: print('x' * 100)": ("output_limit", "File too large"),
    "print('y' * 1000)": ("ok", "y" * 64),
}


@pytest.mark.parametrize("code", list(CASES), ids=range(len(CASES)))
def test_each_snippet_ends_in_its_outcome_within_its_limits(code):
    outcome, text = CASES[code]
    t0 = time.monotonic()
    r = run_python_sync(code, LIMITS)
    assert time.monotonic() - t0 < LIMITS.wall_s + 3  # the wall limit bounds every outcome
    assert r.outcome == outcome, (r.outcome, r.stderr)
    assert text in (r.stdout if outcome == "ok" else r.stderr), r
    if code == "print('y' * 1000)":
        assert r.cut and r.stdout == "y" * 64 and r.text().endswith("[output cut]")


def test_writes_stay_in_the_snippets_own_directory(tmp_path):
    outside = tmp_path / "evil.txt"
    r = run_python_sync(f"open({str(outside)!r}, 'w').write('x')", LIMITS)
    assert r.outcome == "blocked" and not outside.exists()
    r = run_python_sync(f"import os\nos.remove({str(tmp_path)!r})", LIMITS)
    assert r.outcome == "blocked" and tmp_path.exists()
    r = run_python_sync("open('a.txt', 'w').write('hi')\nprint(open('a.txt').read())", LIMITS)
    assert r.outcome == "ok" and r.stdout == "hi\n"
    # every run is a fresh directory: the file is gone
    r = run_python_sync("import os\nprint(os.path.exists('a.txt'))", LIMITS)
    assert r.stdout == "False\n"


def test_runs_go_on_concurrently_on_one_loop():
    """Four snippets at once on one event loop (an agent's rollout): a spinning one does not
    hold up the others."""

    async def main():
        t0 = time.monotonic()
        spin = asyncio.ensure_future(run_python("while True: pass", LIMITS))
        quick = await asyncio.gather(*[run_python(f"print({i} * 7)", LIMITS) for i in range(3)])
        t_quick = time.monotonic() - t0
        return quick, await spin, t_quick

    quick, spin, t_quick = asyncio.run(main())
    assert [r.stdout for r in quick] == ["0\n", "7\n", "14\n"]
    assert spin.outcome == "cpu_limit"
    assert t_quick < LIMITS.wall_s
    assert os.getpid()  # this process is untouched
