"""An MCP tool server the tests launch (issue 64), written with the ``mcp`` SDK's own server:
``python tests/mcp_server.py stdio PIDFILE`` or ``... http PIDFILE PORT``. Its pid goes to
PIDFILE (appended: a restarted server adds a line), so a test sees that a hung one was killed."""

import os
import sys
import time

from mcp.server.mcpserver import MCPServer

server = MCPServer("p3o-test-tools")


@server.tool()
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


@server.tool()
def shout(text: str) -> str:
    """The text in capitals."""
    return text.upper()


@server.tool()
def spin(seconds: float) -> str:
    """Busy for ``seconds`` (blocks the whole server: a hung tool)."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass
    return "done"


@server.tool()
def fails(why: str) -> str:
    """Raises."""
    raise ValueError(why)


if __name__ == "__main__":
    with open(sys.argv[2], "a") as f:
        f.write(f"{os.getpid()}\n")
    if sys.argv[1] == "stdio":
        server.run("stdio")
    else:
        server.run("streamable-http", host="127.0.0.1", port=int(sys.argv[3]))
