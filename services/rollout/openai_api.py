"""The policy over the OpenAI API: ``POST /v1/chat/completions``, ``GET /v1/models``, ``GET /health`` (litestar).

A rollout replica with ``serve.enabled`` answers chat completions with its own engine (the continuous
engine by default: concurrent requests share its decode steps) while it follows the trainer's weight
broadcasts like any replica, so an external agent framework talks to the model being trained. Each
answer says which policy version made it (``system_fingerprint`` ``jetrl-policy-v<N>`` and the header
``x-jetrl-policy-version``); ``/health`` says when the run it follows has ended (the trainer's
``TrainingFinished``): the weights it serves are then the run's last.

The prompt is the one the rollout builds (``chat.render_chat``: tools in the system prompt, earlier
tool calls as ``<tool_call>`` blocks, tool results as ``<tool_response>``), and a ``<tool_call>`` in the
generated text comes back in the API's ``tool_calls`` with ``finish_reason = "tool_calls"``. Supported:
``messages``, ``tools``, ``tool_choice`` (``none`` hides the tools; ``required`` and a named function start
the answer as a call, prefilled up to the function's name or its arguments, so the model writes the rest),
``temperature`` (0 = greedy), ``max_tokens`` / ``max_completion_tokens``, ``n``, ``stop`` (the text and the
usage end where a stop string begins), ``logprobs`` (each generated token's logprob; ``top_logprobs`` only 0:
the engine keeps the sampled token's alone), ``stream`` (the whole answer in one chunk: the engine generates
a turn at once) with ``stream_options.include_usage``. Any other parameter the API defines is refused with a
400 that names it, unless it has its neutral value (``top_p`` 1, ``seed`` null, ...): a server that ignored
it would answer something else than was asked. Bad requests get the API's error body with 400 / 401 / 404.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import structlog
from litestar import Litestar, Request, Response, get, post
from litestar.exceptions import HTTPException
from litestar.response import Stream

from services.rollout.engine import Engine
from shared.chat import parse_assistant, render_chat
from shared.config import ServeConfig

log = structlog.get_logger()

ROLES = ("system", "user", "assistant", "tool", "developer")
MAX_CHOICES = 8
SUPPORTED = {"model", "messages", "tools", "tool_choice", "temperature", "max_tokens", "max_completion_tokens", "n",
             "stop", "stream", "stream_options", "logprobs", "user", "metadata"}
# what the API defines and this server does not do: accepted only with the value that changes nothing
NEUTRAL: dict[str, tuple[Any, ...]] = {
    "top_p": (1, 1.0), "frequency_penalty": (0, 0.0), "presence_penalty": (0, 0.0), "logit_bias": ({},),
    "top_logprobs": (0,), "parallel_tool_calls": (True,), "response_format": ({"type": "text"},), "seed": (),
    "store": (False,), "service_tier": ("auto", "default"), "modalities": (["text"],), "reasoning_effort": (),
    "prediction": (), "audio": (), "functions": (), "function_call": (), "web_search_options": ()}


class APIError(HTTPException):
    """An error in the OpenAI shape: ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(status_code=status, detail=message)
        self.body = {"error": {"message": message, "type": kind, "param": param, "code": code}}


def _error_response(_: Request[Any, Any, Any], exc: APIError) -> Response[dict[str, Any]]:
    return Response(exc.body, status_code=exc.status_code)


def choice_message(text: str, finish_reason: str, parse_tools: bool) -> tuple[dict[str, Any], str]:
    """The API's assistant message and finish reason for one generated text. A well-formed ``<tool_call>``
    becomes ``tool_calls`` (ids unique per call, arguments a JSON string); a broken one stays in the
    content, as the model wrote it, so the client sees what went wrong."""
    if not parse_tools:
        return {"role": "assistant", "content": text}, finish_reason
    parsed = parse_assistant(text, 0)
    calls = parsed.get("tool_calls")
    if not calls:
        return {"role": "assistant", "content": text}, finish_reason
    for call in calls:
        call["id"] = f"call_{uuid.uuid4().hex[:24]}"
    return {"role": "assistant", "content": parsed["content"] or None, "tool_calls": calls}, "tool_calls"


def _check_messages(messages: Any) -> list[dict[str, Any]]:
    if not isinstance(messages, list) or not messages:
        raise APIError(400, "'messages' must be a non-empty list", param="messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise APIError(400, f"messages[{i}]: expected an object with a role in {', '.join(ROLES)}",
                           param=f"messages[{i}]")
        if m["role"] == "developer":  # the newer name of the system role
            messages[i] = dict(m, role="system")
    return messages


def _check_tools(tools: Any) -> list[dict[str, Any]]:
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise APIError(400, "'tools' must be a list", param="tools")
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise APIError(400, f"tools[{i}]: expected {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}",
                           param=f"tools[{i}]")
    return tools


def _number(body: dict[str, Any], key: str, default: Any, kind: type, low: float, high: float) -> Any:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and not isinstance(value, int)):
        raise APIError(400, f"'{key}' must be a{'n integer' if kind is int else ' number'}", param=key)
    if not low <= value <= high:
        raise APIError(400, f"'{key}' must be between {low:g} and {high:g}, got {value}", param=key)
    return kind(value)


def _refuse_unsupported(body: dict[str, Any]) -> None:
    """A 400 naming every parameter this server would otherwise ignore (unknown ones included, as the API does)."""
    ignored = sorted(k for k, v in body.items() if v is not None and k not in SUPPORTED and v not in NEUTRAL.get(k, ()))
    if ignored:
        raise APIError(400, f"unsupported parameter{'s' if len(ignored) > 1 else ''}: {', '.join(ignored)} (this "
                            "server does not implement them; it supports " + ", ".join(sorted(SUPPORTED)) + ")",
                       param=ignored[0], code="unsupported_parameter")


def forced_call_prefix(tool_choice: Any, tools: list[dict[str, Any]]) -> str:
    """The start of the answer that ``tool_choice`` asks for: '' (auto), ``<tool_call>`` up to the function's
    name (required) or up to its arguments (a named function), as ``chat.render_tool_call`` writes a call."""
    if tool_choice in (None, "auto", "none"):
        return ""
    if not tools:
        raise APIError(400, "'tool_choice' asks for a tool call, but the request has no 'tools'", param="tool_choice")
    if tool_choice == "required":
        return '<tool_call>\n{"name": "'
    fn = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    if not isinstance(fn, dict) or tool_choice.get("type", "function") != "function":
        raise APIError(400, "'tool_choice' must be none, auto, required or {\"type\": \"function\", \"function\": "
                            "{\"name\": ...}}", param="tool_choice")
    names = [t["function"]["name"] for t in tools]
    if fn.get("name") not in names:
        raise APIError(400, f"'tool_choice' names {fn.get('name')!r}, which is not among the tools ({', '.join(names)})",
                       param="tool_choice")
    return "<tool_call>\n" + json.dumps({"name": fn["name"]}, ensure_ascii=False)[:-1] + ', "arguments": '


def tokens_up_to(tokenizer: Any, tokens: list[int], chars: int) -> int:
    """How many of ``tokens`` it takes to write the first ``chars`` characters of their text (a stop string
    cuts the text there: the usage and the logprobs count those tokens, not the ones after it)."""
    for k in range(len(tokens) + 1):
        if len(tokenizer.decode(tokens[:k], skip_special_tokens=True)) >= chars:
            return k
    return len(tokens)


class ChatCompletions:
    """Turns API requests into engine generations; ``version`` reads the policy version being served."""

    def __init__(self, engine: Engine, tokenizer: Any, cfg: ServeConfig, tool_format: str, max_context: int) -> None:
        self.engine, self.tokenizer, self.cfg = engine, tokenizer, cfg
        self.tool_format, self.max_context = tool_format, max_context
        self.requests = 0
        self.run_ended: dict[str, Any] | None = None  # the trainer's TrainingFinished, once the run has ended

    def logprobs_of(self, tokens: list[int], logprobs: list[float]) -> dict[str, Any]:
        """The API's ``choices[].logprobs``: each generated token, its logprob, its UTF-8 bytes."""
        content = []
        for token, logprob in zip(tokens, logprobs, strict=True):
            text = self.tokenizer.decode([token], skip_special_tokens=False)
            content.append({"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8")),
                            "top_logprobs": []})
        return {"content": content, "refusal": None}

    async def complete(self, body: dict[str, Any]) -> dict[str, Any]:
        model = body.get("model")
        if model not in (self.cfg.model_name, None, ""):
            raise APIError(404, f"The model '{model}' does not exist; this server serves '{self.cfg.model_name}'",
                           param="model", code="model_not_found")
        _refuse_unsupported(body)
        messages = _check_messages(body.get("messages"))
        tools = _check_tools(body.get("tools"))
        tool_choice = body.get("tool_choice", "auto")
        forced = forced_call_prefix(tool_choice, tools)
        if tool_choice == "none":
            tools = []
        want_logprobs = body.get("logprobs") or False
        if not isinstance(want_logprobs, bool):
            raise APIError(400, "'logprobs' must be true or false", param="logprobs")
        options = body.get("stream_options")
        if options is not None and (not body.get("stream") or not isinstance(options, dict)
                                    or set(options) - {"include_usage"}):
            raise APIError(400, "'stream_options' is only {\"include_usage\": true|false}, with stream", param="stream_options")
        temperature = _number(body, "temperature", 1.0, float, 0.0, 2.0)
        max_tokens = _number(body, "max_completion_tokens", None, int, 1, self.max_context)
        max_tokens = max_tokens or _number(body, "max_tokens", self.cfg.max_tokens, int, 1, self.max_context)
        n = _number(body, "n", 1, int, 1, MAX_CHOICES)
        stop = body.get("stop") or []
        stop = [stop] if isinstance(stop, str) else stop
        if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop) or len(stop) > 4:
            raise APIError(400, "'stop' must be a string or a list of at most 4 strings", param="stop")
        try:
            prompt_text = render_chat(messages, tools, self.tool_format)
        except (KeyError, TypeError, ValueError, json.JSONDecodeError) as exc:
            raise APIError(400, f"cannot render the conversation: {exc!r}", param="messages") from None
        prompt = self.tokenizer.encode(prompt_text + forced, add_special_tokens=False)
        if len(prompt) + max_tokens > self.max_context:
            raise APIError(400, f"This model's maximum context length is {self.max_context} tokens; the messages "
                                f"take {len(prompt)} and max_tokens asks for {max_tokens} more",
                           param="messages", code="context_length_exceeded")
        self.requests += 1
        gens = await asyncio.gather(*(self.engine.generate(prompt, max_tokens, temperature) for _ in range(n)))
        choices, completion = [], 0
        for i, gen in enumerate(gens):
            text = self.tokenizer.decode(gen.tokens, skip_special_tokens=True)
            finish, kept = gen.finish_reason, len(gen.tokens)
            cut = min((text.find(s) for s in stop if s in text), default=-1)
            if cut >= 0:  # the answer, its usage and its logprobs end where the stop string begins
                text, finish, kept = text[:cut], "stop", tokens_up_to(self.tokenizer, gen.tokens, cut)
            completion += kept
            message, finish = choice_message(forced + text, finish, parse_tools=bool(tools))
            choices.append({"index": i, "message": message, "finish_reason": finish,
                            "logprobs": self.logprobs_of(gen.tokens[:kept], gen.logprobs[:kept]) if want_logprobs
                            else None})
        version = min(g.policy_version for g in gens)
        return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
                "model": self.cfg.model_name, "system_fingerprint": f"jetrl-policy-v{version}", "choices": choices,
                "usage": {"prompt_tokens": len(prompt), "completion_tokens": completion,
                          "total_tokens": len(prompt) + completion}}


def _chunks(result: dict[str, Any], include_usage: bool = False) -> AsyncIterator[bytes]:
    """A finished completion as the API's stream: per choice, the role, the content / tool calls (and their
    logprobs), the finish reason; with ``include_usage`` a last chunk without choices holds the usage (and
    every other chunk ``usage: null``, as the API does); then ``[DONE]``."""
    async def gen() -> AsyncIterator[bytes]:
        base = {k: result[k] for k in ("id", "created", "model", "system_fingerprint")}
        if include_usage:
            base["usage"] = None
        for c in result["choices"]:
            msg = c["message"]
            delta: dict[str, Any] = {"role": "assistant", "content": msg.get("content")}
            if msg.get("tool_calls"):
                delta["tool_calls"] = [dict(call, index=j) for j, call in enumerate(msg["tool_calls"])]
            for d, finish, logprobs in ((delta, None, c["logprobs"]), ({}, c["finish_reason"], None)):
                chunk = dict(base, object="chat.completion.chunk",
                             choices=[{"index": c["index"], "delta": d, "finish_reason": finish, "logprobs": logprobs}])
                yield f"data: {json.dumps(chunk)}\n\n".encode()
        if include_usage:
            yield f"data: {json.dumps(dict(base, object='chat.completion.chunk', choices=[], usage=result['usage']))}\n\n".encode()
        yield b"data: [DONE]\n\n"
    return gen()


def create_app(chat: ChatCompletions) -> Litestar:
    def check_key(request: Request[Any, Any, Any]) -> None:
        if chat.cfg.api_key and request.headers.get("authorization", "") != f"Bearer {chat.cfg.api_key}":
            raise APIError(401, "Incorrect API key provided", code="invalid_api_key")

    @post("/v1/chat/completions", status_code=200)
    async def chat_completions(request: Request[Any, Any, Any]) -> Response[Any]:
        check_key(request)
        try:
            body = await request.json()
        except Exception:
            raise APIError(400, "the request body is not valid JSON") from None
        if not isinstance(body, dict):
            raise APIError(400, "the request body must be a JSON object")
        started = time.monotonic()
        result = await chat.complete(body)
        version = result["system_fingerprint"].rsplit("v", 1)[1]
        log.info("chat_completion", choices=len(result["choices"]), usage=result["usage"], policy_version=version,
                 seconds=round(time.monotonic() - started, 3))
        headers = {"x-jetrl-policy-version": version}
        if body.get("stream"):
            include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
            return Stream(_chunks(result, include_usage), media_type="text/event-stream", headers=headers)
        return Response(result, headers=headers)

    @get("/v1/models")
    async def models(request: Request[Any, Any, Any]) -> dict[str, Any]:
        check_key(request)
        return {"object": "list", "data": [{"id": chat.cfg.model_name, "object": "model", "created": 0,
                                            "owned_by": "jetrl", "policy_version": chat.engine.policy_version}]}

    @get("/health")
    async def health() -> dict[str, Any]:
        # still up and answering after its run has ended, but with the run's last weights: say so
        out = {"status": "run_ended" if chat.run_ended else "ok", "policy_version": chat.engine.policy_version,
               "requests": chat.requests}
        return out | {"run_ended": chat.run_ended} if chat.run_ended else out

    return Litestar([chat_completions, models, health], exception_handlers={APIError: _error_response})
