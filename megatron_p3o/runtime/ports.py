"""Free TCP ports for listeners the trainer starts (servers, routers, rendezvous stores).

A port the kernel hands out for ``bind(('', 0))`` comes from the ephemeral range
(``/proc/sys/net/ipv4/ip_local_port_range``, 32768-60999 on Linux), the same range every gloo
pair, TCPStore client and HTTP connection draws its local port from. Between choosing such a port
and a server binding it (an SGLang server binds ~30 s after launch, once its tokenizer is up), a
gloo group of the trainer may take it: CI saw ``[Errno 98] address already in use``. So a free
port is drawn at random *below* the ephemeral range, where the kernel never assigns on its own,
and checked by binding it.
"""

from __future__ import annotations

import random
import socket

_FLOOR = 10000


def ephemeral_range() -> tuple[int, int]:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            lo, hi = (int(x) for x in f.read().split())
        return lo, hi
    except (OSError, ValueError):
        return 32768, 60999


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now, outside the kernel's ephemeral range."""
    lo, hi = ephemeral_range()
    pool = range(_FLOOR, lo) if lo - _FLOOR >= 1000 else range(hi + 1, 65536)
    rng = random.SystemRandom()
    for _ in range(200):
        port = rng.choice(pool)
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # everything tried was taken: let the kernel choose
        s.bind((host, 0))
        return s.getsockname()[1]
