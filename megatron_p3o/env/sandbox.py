"""A Python snippet run in a sandboxed subprocess: the code tool of agents and environments.

Why a subprocess with limits, not ``exec``: the snippet is what a policy wrote, and a policy
under RL writes whatever earns reward — infinite loops, unbounded allocations, forks, writes
anywhere, network calls. None of it may reach the trainer. Each run is a fresh interpreter
(``python -I -S``: no environment variables, no site-packages, the standard library only) in a
fresh temporary directory (its working directory and ``HOME``, deleted afterwards), with:

- **wall time** ``wall_s`` (the process group is killed) and **CPU time** ``cpu_s``
  (``RLIMIT_CPU``: SIGXCPU, then SIGKILL a second later);
- **memory** ``memory_mb`` (``RLIMIT_AS``: an allocation past it raises ``MemoryError``);
- **files** ``files_mb`` per file (``RLIMIT_FSIZE``: a write past it fails), 64 descriptors,
  no new processes (``RLIMIT_NPROC`` 0; for root, whom that does not bind, the audit hook below);
- **no network**: its own empty network namespace where the kernel gives one (root, or
  unprivileged user namespaces), and in every case no ``socket`` module;
- **an audit hook** (PEP 578, installed before the snippet runs, which cannot remove it):
  process creation (``os.fork``, ``os.system``, ``os.exec*``, ``os.spawn*``, ``os.posix_spawn``,
  ``subprocess.Popen``), signals to other processes, ``ctypes`` and the ``socket`` modules, and
  any write, rename or removal outside its directory raise ``PermissionError("sandbox: ...")``;
- **output** cut to ``output_bytes`` (stdout and stderr go to files bounded by ``files_mb``).

Outcomes (:attr:`SandboxResult.outcome`): ``ok`` (exit 0), ``error`` (an exception: the last
line of its traceback), ``blocked`` (the audit hook refused an operation), ``memory``
(``MemoryError``), ``output_limit`` (a write past ``files_mb``: output without end),
``cpu_limit``, ``timeout`` (wall), ``killed`` (another signal). What it is
not: a defence against a determined attacker with a kernel exploit; it bounds what a policy's
snippet can do to the run (docs/agents.md).
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

_BOOT = r"""
import os, resource, sys
lim = [int(x) for x in sys.argv[1:6]]
resource.setrlimit(resource.RLIMIT_CPU, (lim[0], lim[0] + 1))
resource.setrlimit(resource.RLIMIT_AS, (lim[1], lim[1]))
resource.setrlimit(resource.RLIMIT_FSIZE, (lim[2], lim[2]))
resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
try:
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(0x40000000) != 0:  # CLONE_NEWNET; unprivileged: with CLONE_NEWUSER
        libc.unshare(0x10000000 | 0x40000000)
    del ctypes, libc
except Exception:
    pass
for m in [m for m in sys.modules if m.split(".")[0] in ("ctypes", "_ctypes")]:
    del sys.modules[m]  # imported here, so the snippet's import meets the hook
try:
    resource.setrlimit(resource.RLIMIT_NPROC, (0, 0))
except (ValueError, OSError):
    pass
ROOT = os.path.realpath(os.getcwd()) + os.sep
code = open(0, encoding="utf-8", errors="replace").read()
W = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
SPAWN = ("os.fork", "os.forkpty", "os.system", "os.posix_spawn", "os.kill", "os.killpg",
         "subprocess.Popen", "pty.spawn", "os.add_dll_directory")
PATHS = ("os.remove", "os.rename", "os.rmdir", "os.mkdir", "os.symlink", "os.link", "os.chmod",
         "os.chown", "os.truncate", "os.utime", "shutil.rmtree", "shutil.move", "os.removexattr",
         "os.setxattr")
NO_IMPORT = ("ctypes", "_ctypes", "socket", "_socket", "_posixsubprocess", "mmap")
def inside(p):
    if isinstance(p, int):
        return True
    try:
        p = os.fsdecode(p)
    except TypeError:
        return False
    return os.path.realpath(p).startswith(ROOT)
def hook(event, args):
    if event in SPAWN or event.startswith(("os.exec", "os.spawn")):
        raise PermissionError(f"sandbox: {event} is not allowed")
    if event == "import" and args[0] in NO_IMPORT:
        raise PermissionError(f"sandbox: import {args[0]} is not allowed")
    if event == "open":
        path, mode, flags = args
        writing = (mode is not None and any(c in str(mode) for c in "wax+")) or (
            mode is None and flags & W)
        if writing and not inside(path):
            raise PermissionError(f"sandbox: writing {path!r} outside its directory")
    elif event in PATHS:
        for p in args[:2]:
            if isinstance(p, (str, bytes, os.PathLike)) and not inside(p):
                raise PermissionError(f"sandbox: {event} on {p!r} outside its directory")
sys.addaudithook(hook)
del resource
g = {"__name__": "__main__", "__builtins__": __builtins__}
exec(compile(code, "<snippet>", "exec"), g)
"""


@dataclass(frozen=True)
class Limits:
    """The sandbox's bounds (module docstring)."""

    wall_s: float = 5.0
    cpu_s: int = 2
    memory_mb: int = 256
    files_mb: int = 1
    output_bytes: int = 2048


@dataclass
class SandboxResult:
    """``outcome`` (module docstring), the snippet's ``stdout`` and ``stderr`` (cut), its exit
    ``code`` (negative: the signal), whether the output was ``cut``, and its wall seconds
    (``stderr``: its last 4 KiB or ``output_bytes``, whichever is more: a traceback's end)."""

    outcome: str
    stdout: str
    stderr: str
    code: int
    cut: bool
    wall_s: float

    def text(self) -> str:
        """What a tool returns to the model: stdout if it ran, else the outcome and the error."""
        if self.outcome == "ok":
            return self.stdout + ("\n[output cut]" if self.cut else "")
        last = self.stderr.strip().splitlines()[-1:] or [""]
        return f"[{self.outcome}] {last[0]}".strip()


def _read(path: Path, limit: int, tail: bool = False):
    """The first (``tail``: last) ``limit`` bytes of a file as text, and whether there was
    more."""
    try:
        with open(path, "rb") as f:
            size = f.seek(0, 2)
            f.seek(max(0, size - limit) if tail else 0)
            data = f.read(limit)
    except OSError:
        return "", False
    return data.decode("utf-8", errors="replace"), size > limit


def _outcome(code: int, stderr: str, timed_out: bool) -> str:
    if timed_out:
        return "timeout"
    if code == 0:
        return "ok"
    # SIGXCPU is RLIMIT_CPU's; SIGKILL before the wall limit is its hard limit (a snippet that
    # ignored SIGXCPU): the parent kills only at the wall limit
    if code in (-signal.SIGXCPU, -signal.SIGKILL):
        return "cpu_limit"
    if code < 0:
        return "killed"
    if "PermissionError: sandbox:" in stderr:
        return "blocked"
    if "MemoryError" in stderr:
        return "memory"
    if "[Errno 27] File too large" in stderr:
        return "output_limit"
    return "error"


async def run_python(code: str, limits: Limits = Limits()) -> SandboxResult:
    """Run ``code`` in the sandbox (module docstring); never raises for what the code does."""
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="p3o-sandbox-") as d:
        out, err = Path(d) / ".stdout", Path(d) / ".stderr"
        env = {"HOME": d, "TMPDIR": d, "PATH": "/usr/bin:/bin", "PYTHONHASHSEED": "0",
               "LANG": "C.UTF-8"}  # fmt: skip
        args = [str(limits.cpu_s), str(limits.memory_mb << 20), str(limits.files_mb << 20),
                "0", "0"]  # fmt: skip
        with open(out, "wb") as fo, open(err, "wb") as fe:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-I", "-S", "-c", _BOOT, *args, stdin=asyncio.subprocess.PIPE,
                stdout=fo, stderr=fe, cwd=d, env=env, start_new_session=True,
            )  # fmt: skip
        timed_out = False
        try:
            await asyncio.wait_for(proc.communicate(code.encode("utf-8", "replace")),
                                   limits.wall_s)  # fmt: skip
        except asyncio.TimeoutError:
            timed_out = True
        except asyncio.CancelledError:
            _kill(proc)
            raise
        finally:
            _kill(proc)
        await proc.wait()
        stdout, cut = _read(out, limits.output_bytes)
        stderr, _ = _read(err, max(limits.output_bytes, 4096), tail=True)  # the traceback's end
    code_ = proc.returncode if proc.returncode is not None else -signal.SIGKILL
    outcome = _outcome(code_, stderr, timed_out)
    return SandboxResult(outcome, stdout, stderr, code_, cut, time.monotonic() - t0)


def _kill(proc) -> None:
    if proc.returncode is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def run_python_sync(code: str, limits: Limits = Limits()) -> SandboxResult:
    """:func:`run_python` from synchronous code (an environment's ``step`` in its worker)."""
    return asyncio.run(run_python(code, limits))
