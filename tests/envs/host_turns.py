"""Driving a real ``EnvHost`` turn by turn without a broker (its handlers take and return the wire bytes), for
the env tests of what the host does with a whole assistant message: several tool calls in one message."""

from __future__ import annotations

import json
from typing import Any

from services.envs.base import TaskEnv
from services.envs.host import EnvHost
from shared.config import EnvConfig
from shared.messages import EnvCancel, EnvInteract, EnvStart, EnvStarted, EnvStep, decode, encode
from shared.subjects import Subjects


def assistant_calls(*calls: tuple[str, dict[str, Any]], content: str = "") -> dict[str, Any]:
    """An assistant message with these (name, arguments) tool calls, ids c0, c1, ..."""
    return {"role": "assistant", "content": content, "tool_calls": [
        {"id": f"c{k}", "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}
        for k, (name, args) in enumerate(calls)]}


class HostSession:
    """One session of ``env`` on a fresh host; ``turn(message)`` answers as ``interact`` does."""

    def __init__(self, env: TaskEnv, cfg: EnvConfig) -> None:
        self.host = EnvHost(env, cfg, Subjects("t"), "r1")
        self.turns = 0

    async def start(self, task_id: str, split: str) -> EnvStarted:
        return decode(await self.host.start(encode(EnvStart(session_id="s", task_id=task_id, split=split))),
                      EnvStarted)

    async def turn(self, msg: dict[str, Any]) -> EnvStep:
        step = decode(await self.host.interact(encode(EnvInteract(session_id="s", message=msg, turn=self.turns))),
                      EnvStep)
        self.turns += 1
        return step

    async def close(self) -> None:
        """Cancel the session if it is still open and stop the host's threads; the env stays open (a module's)."""
        if "s" in self.host.sessions:
            await self.host.cancel(encode(EnvCancel(session_id="s")))
        self.host.pool.close()
