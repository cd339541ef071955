"""MCP tool servers (issue 64), real ones: tests/mcp_server.py, written with the ``mcp`` SDK's
own server, launched over stdio by the SDK's client and over streamable HTTP by the test. Their
tools are listed as OpenAI schemas, called, timed out; a hung stdio server is killed (its pid
gone) and started again; an agent passes them to the template and sends their results back
through the endpoint."""

import asyncio
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron_p3o.env.config import MultiTurnConfig
from megatron_p3o.env.mcp_tools import MCPToolbox
from megatron_p3o.runtime.errors import ConfigError

SERVER = str(Path(__file__).resolve().parent.parent / "mcp_server.py")


def alive(pid: str) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except OSError:
        return False


def test_a_stdio_server_is_listed_called_timed_out_and_killed_when_it_hangs(tmp_path):
    pids = tmp_path / "pids"

    async def main():
        box = MCPToolbox([{"command": sys.executable, "args": [SERVER, "stdio", str(pids)]}], 2.0)
        await box.start()
        try:
            names = [s["function"]["name"] for s in box.schemas]
            add = box.schemas[names.index("add")]["function"]
            got = [await box.call("add", {"a": 2, "b": 3}), await box.call("shout", {"text": "hi"}),
                   await box.call("fails", {"why": "no"}), await box.call("nope", {})]  # fmt: skip
            first = pids.read_text().split()
            t0 = time.monotonic()
            hung = await box.call("spin", {"seconds": 120})
            t_hung = time.monotonic() - t0
            dead = not alive(first[0])
            after = await box.call("add", {"a": 1, "b": 1})  # a new server
            return names, add, got, first, hung, t_hung, dead, after
        finally:
            await box.close()

    names, add, got, first, hung, t_hung, dead, after = asyncio.run(main())
    assert names == ["add", "shout", "spin", "fails"]
    assert add["parameters"]["properties"] == {"a": {"title": "A", "type": "integer"},
                                               "b": {"title": "B", "type": "integer"}}  # fmt: skip
    assert add["description"] == "Add two integers."
    assert got[0] == ("5", True) and got[1] == ("HI", True)
    assert got[2][1] is False and got[3] == ("error: no tool named 'nope'", False)
    assert hung == ("error: the tool spin ran past 2 s", False) and t_hung < 15
    assert dead  # the hung server's process was killed
    assert after == ("2", True)
    every = pids.read_text().split()
    assert len(every) == 2 and not any(alive(p) for p in every)  # close stops the new one too


def test_a_streamable_http_server_is_listed_called_and_a_hung_call_abandoned(tmp_path):
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    proc = subprocess.Popen([sys.executable, SERVER, "http", str(tmp_path / "p"), str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        for _ in range(300):
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                time.sleep(0.1)

        async def main():
            box = MCPToolbox([{"url": f"http://127.0.0.1:{port}/mcp"}], 2.0)
            await box.start()
            try:
                return ([s["function"]["name"] for s in box.schemas],
                        await box.call("add", {"a": 40, "b": 2}),
                        await box.call("spin", {"seconds": 3}))  # fmt: skip
            finally:
                await box.close()

        names, added, hung = asyncio.run(main())
    finally:
        proc.kill()
        proc.wait()
    assert names == ["add", "shout", "spin", "fails"]
    assert added == ("42", True)
    assert hung == ("error: the tool spin ran past 2 s", False)


@pytest.mark.parametrize(
    "kw, msg",
    [
        (dict(agent="tests.agents:raises", mcp_servers=[{"cmd": "x"}]), "either 'command'"),
        (dict(env="tests.envs:EchoEnv", mcp_servers=[{"url": "http://x"}]), "needs an agent"),
    ],
)
def test_mcp_config_errors_name_the_key(kw, msg):
    with pytest.raises(ConfigError, match=msg):
        MultiTurnConfig(**kw)


def test_a_server_that_does_not_start_is_one_error_naming_it():
    async def main():
        box = MCPToolbox([{"command": sys.executable, "args": ["-c", "raise SystemExit(3)"]}], 2.0)
        try:
            await box.start()
        finally:
            await box.close()

    with pytest.raises(ConfigError, match=r"mcp_servers\[0\]=.*cannot connect"):
        asyncio.run(main())
    assert os.getpid()
