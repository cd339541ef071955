"""What the benchmarks share about the machine they run on: the CPU's name (printed with every
result) and the pinned environment of the TRL peer (``bench_peer_trl``, ``bench_step_profile``).
A module of its own so the benchmark scripts never import one another (no import circle)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def cpu_model() -> str:
    """The CPU's model name (lscpu, else /proc/cpuinfo)."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except (OSError, subprocess.CalledProcessError):
        pass
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return "unknown CPU"


def trl_python(venv: Path) -> str:
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
