"""An MCP tool server written for the tests with PyPI ``mcp``: SQL over an SQLite database of its own per MCP
session (a stdio process is one session; over streamable HTTP each ``Mcp-Session-Id`` has its own), plus a
verifier tool. ``python -m tests.servers.sql_tools stdio``, ``... http PORT`` or ``... http-stateless PORT``
(stateless streamable HTTP: no ``Mcp-Session-Id``, one database for every request). The tool ``crash`` kills
the server (a server that dies mid-episode); ``wait`` is a slow tool."""

from __future__ import annotations

import os
import sqlite3
import sys

import anyio
from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ToolError

server = MCPServer("sql-tools")
databases: dict[str, sqlite3.Connection] = {}


def database(ctx: Context) -> sqlite3.Connection:
    headers = ctx.headers or {}
    key = headers.get("mcp-session-id", "stdio")
    if key not in databases:
        databases[key] = sqlite3.connect(":memory:", check_same_thread=False)
    return databases[key]


@server.tool()
def execute_sql(query: str, ctx: Context) -> str:
    """Run one SQL statement on this session's database and return its rows."""
    db = database(ctx)
    try:
        cursor = db.execute(query)
    except sqlite3.Error as exc:
        raise ToolError(f"SQL error: {exc}") from None
    db.commit()
    rows = cursor.fetchall()
    return repr(rows) if cursor.description else f"ok, {cursor.rowcount} row(s) changed"


@server.tool()
def list_tables(ctx: Context) -> list[str]:
    """The tables of this session's database."""
    return [r[0] for r in database(ctx).execute("SELECT name FROM sqlite_master WHERE type = 'table' ORDER BY name")]


@server.tool()
def check_total(answer: str, table: str, ctx: Context) -> float:
    """Verifier: 1.0 when the answer is the sum of the table's amount column, else 0.0."""
    try:
        (total,) = database(ctx).execute(f"SELECT COALESCE(SUM(amount), 0) FROM {table}").fetchone()
        return 1.0 if float(answer) == float(total) else 0.0
    except (ValueError, sqlite3.Error):
        return 0.0


@server.tool()
def getenv(name: str) -> str:
    """An environment variable of this server's process ('' if unset)."""
    return os.environ.get(name, "")


@server.tool()
async def wait(seconds: float) -> str:
    """Answer after this many seconds (a slow tool)."""
    await anyio.sleep(seconds)
    return "waited"


@server.tool()
def crash() -> str:
    """Kill this server at once."""
    os._exit(3)


if __name__ == "__main__":
    if sys.argv[1:2] in (["http"], ["http-stateless"]):
        server.run("streamable-http", host="127.0.0.1", port=int(sys.argv[2]),
                   stateless_http=sys.argv[1] == "http-stateless")
    else:
        server.run()
