"""Peak-memory probes for the benchmarks (Linux /proc)."""

from __future__ import annotations

import os


def rss_mb() -> float:
    """Current resident set size, MB."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def reset_peak() -> None:
    """Reset the kernel's resident high-water mark (VmHWM) to the current RSS (Linux ≥ 4.0).
    ``ru_maxrss`` would not do: it keeps the peak of the parent image this process forked from."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def peak_mb() -> float:
    """Resident high-water mark since the last :func:`reset_peak`, MB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM in /proc/self/status")
