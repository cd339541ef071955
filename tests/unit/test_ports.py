"""Ports the trainer and the tests choose for listeners stay out of the kernel's ephemeral range,
where gloo's own connections take theirs (CI once lost an SGLang server to ``address already in
use`` on a port chosen by ``bind(('', 0))`` half a minute before the server bound it)."""

import socket

from megatron_p3o.runtime.ports import ephemeral_range, free_port


def test_free_ports_are_bindable_and_never_ephemeral():
    lo, hi = ephemeral_range()
    ports = {free_port() for _ in range(50)}
    assert len(ports) > 40  # drawn at random, not one fixed port
    assert not any(lo <= p <= hi for p in ports)
    for p in list(ports)[:5]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))


def test_a_taken_port_is_not_handed_out():
    taken = []
    try:
        for _ in range(20):
            s = socket.socket()
            s.bind(("127.0.0.1", free_port()))
            s.listen()
            taken.append(s)
        held = {s.getsockname()[1] for s in taken}
        assert not held & {free_port() for _ in range(200)}
    finally:
        for s in taken:
            s.close()
