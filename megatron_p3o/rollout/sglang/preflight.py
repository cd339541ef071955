"""A first-hour check of a GPU node before any SGLang server starts: the NVIDIA driver the
SGLang environment's CUDA needs, and the memory free on each GPU — one line per finding.

Why: the SGLang environment pins a CUDA 13 stack (``constraints-sglang.txt``: torch 2.14.1,
``cuda-toolkit`` 13.0, NCCL cu13), which needs an NVIDIA driver ≥ 580 (CUDA 13.0's minimum for
Linux, NVIDIA's CUDA Toolkit release notes); on an older driver the server fails at start with
CUDA's own message, minutes into the launch. The NCCL versions of the two environments are
checked where a push needs them (:func:`~.weights.check_nccl_versions`).

``nvidia-smi`` is asked, as an operator would; no CUDA context is made. Without it (a CPU
machine, a container without the driver's tools) nothing is checked and the report says so.
"""

from __future__ import annotations

import subprocess
from typing import List, Optional, Tuple

MIN_DRIVER = 580  # CUDA 13.0's minimum Linux driver (the SGLang environment's CUDA)
CUDA_OF_ENV = "13.0"


def gpus() -> Optional[List[Tuple[str, float, float]]]:
    """``(driver version, free MiB, total MiB)`` per GPU from ``nvidia-smi``; None without it."""
    cmd = ["nvidia-smi", "--query-gpu=driver_version,memory.free,memory.total",
           "--format=csv,noheader,nounits"]  # fmt: skip
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if r.returncode != 0:
        return None
    out = []
    for line in r.stdout.strip().splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 3:
            out.append((parts[0], float(parts[1]), float(parts[2])))
    return out or None


def driver_finding(version: str) -> Optional[str]:
    """The one line for a driver too old for the SGLang environment's CUDA, else None."""
    try:
        major = int(version.split(".")[0])
    except ValueError:
        return f"NVIDIA driver {version!r}: not a version this check reads"
    if major >= MIN_DRIVER:
        return None
    return (
        f"NVIDIA driver {version} is older than {MIN_DRIVER}: the SGLang environment's CUDA "
        f"{CUDA_OF_ENV} (constraints-sglang.txt) needs >= {MIN_DRIVER}; servers would fail at "
        "start. Use a node or image with a newer driver (docs/cluster.md: which images pair)"
    )


def report(min_free_gib: float = 0.0) -> List[str]:
    """Findings, one line each (empty: nothing wrong); a line saying nothing was checked on a
    machine without ``nvidia-smi``. ``min_free_gib``: the memory a GPU must have free."""
    found = gpus()
    if found is None:
        return ["preflight: no nvidia-smi here; the driver and GPU memory are checked at launch"]
    lines = []
    bad = {v for v, _, _ in found if driver_finding(v)}
    lines += [driver_finding(v) for v in sorted(bad)]
    for i, (_, free, total) in enumerate(found):
        if free / 1024 < min_free_gib:
            lines.append(
                f"GPU {i}: {free / 1024:.1f} GiB free of {total / 1024:.0f} GiB, "
                f"{min_free_gib:.1f} GiB needed (does another process hold it?)"
            )
    return lines


def check_launch() -> None:
    """Before launching GPU servers: a driver too old is an error (one line); no
    ``nvidia-smi`` is left to the launch itself."""
    from megatron_p3o.rollout.sglang.launch import SGLangSetupError

    found = gpus() or []
    for v, _, _ in found:
        why = driver_finding(v)
        if why is not None:
            raise SGLangSetupError(why)
