"""The ``openai`` engine: each turn is one chat-completions request to an OpenAI-compatible server.

Baselines (an API model, a llama.cpp or vLLM server, another ``jetrl serve``) play the very envs,
grading and report the trained policy does. The conversation goes to the server in the API's own form:
the env's opening messages and tool schemas, each earlier assistant message with its ``tool_calls``, and
each tool result as a ``tool`` message answering its call. The assistant message comes back with the
server's ``tool_calls``, and goes to the env as it is (the env runs the first call; the history keeps
only that one, so every call in it has its answer). A turn with no tool call gets the env's answer as a
``user`` message, since the API has no tool message without a call.

Transient failures (connection refused or reset, 429, 5xx) are retried a few times with backoff; any
other error fails the episode with the server's message.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

import httpx
import structlog

from shared.config import OpenAIEngineConfig

log = structlog.get_logger()

RETRIES = 3


class ChatAPIError(RuntimeError):
    pass


class ContextLimit(ChatAPIError):
    """The server refused the conversation as longer than its context: the episode ends as
    ``agent_context_limit``, as it would with our own engines."""


class OpenAIChatClient:
    def __init__(self, cfg: OpenAIEngineConfig) -> None:
        self.url = cfg.base_url.rstrip("/") + "/chat/completions"
        self.model = cfg.model
        key = cfg.api_key or os.environ.get("OPENAI_API_KEY", "")
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        self.http = httpx.AsyncClient(headers=headers, timeout=cfg.timeout_s)
        self.requests = 0
        self.usage = {"prompt_tokens": 0, "completion_tokens": 0}

    async def complete(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]], temperature: float,
                       max_tokens: int) -> dict[str, Any]:
        """The server's assistant message for this conversation (``content`` and maybe ``tool_calls``)."""
        body: dict[str, Any] = {"model": self.model, "messages": messages, "temperature": temperature,
                                "max_tokens": max_tokens}
        if tools:
            body["tools"] = tools
        for attempt in range(RETRIES + 1):
            try:
                resp = await self.http.post(self.url, json=body)
            except (httpx.ConnectError, httpx.ReadError, httpx.RemoteProtocolError) as exc:
                if attempt == RETRIES:
                    raise ChatAPIError(f"{self.url}: {exc!r}") from None
                await asyncio.sleep(2.0 ** attempt)
                continue
            if resp.status_code == 429 or resp.status_code >= 500:
                if attempt == RETRIES:
                    raise ChatAPIError(f"{self.url}: HTTP {resp.status_code}: {resp.text[:500]}")
                log.warning("chat_api_retry", status=resp.status_code, attempt=attempt)
                await asyncio.sleep(2.0 ** attempt)
                continue
            if resp.status_code != 200:
                text = resp.text[:500]
                if resp.status_code == 400 and ("context_length_exceeded" in text or "context length" in text):
                    raise ContextLimit(f"{self.url}: {text}")
                raise ChatAPIError(f"{self.url}: HTTP {resp.status_code}: {text}")
            data = resp.json()
            self.requests += 1
            for key in self.usage:
                self.usage[key] += int((data.get("usage") or {}).get(key) or 0)
            try:
                message = dict(data["choices"][0]["message"])
            except (KeyError, IndexError, TypeError):
                raise ChatAPIError(f"{self.url}: no choices[0].message in {str(data)[:300]}") from None
            message["role"] = "assistant"
            message["content"] = message.get("content") or ""
            if not message.get("tool_calls"):
                message.pop("tool_calls", None)
            return message
        raise AssertionError("unreachable")

    async def close(self) -> None:
        await self.http.aclose()


def history_after_turn(action: dict[str, Any], observation: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """What one turn adds to the API conversation: the assistant message with at most its first tool call
    (the one the env ran), then the env's answer as that call's ``tool`` message, or as a ``user``
    message when there was no call to answer."""
    calls = action.get("tool_calls") or []
    assistant: dict[str, Any] = {"role": "assistant", "content": action.get("content") or ""}
    if calls:
        assistant["tool_calls"] = calls[:1]
        call_id = calls[0].get("id") or "call_0"
        answers = [dict(m, tool_call_id=call_id) if m.get("role") == "tool" else m for m in observation]
    else:
        answers = [{"role": "user", "content": m.get("content", "")} if m.get("role") == "tool" else m
                   for m in observation]
    return [assistant, *answers]
