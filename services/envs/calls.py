"""Reading the tool calls of an OpenAI assistant message for the env host: which calls of a message run
(the episode's ``calls_per_message`` rule, AgentBench's per task), each call's name and arguments, and
the arguments checked against the tool's schema. Every refusal is a ``ToolError`` with a reason the
agent can read."""

from __future__ import annotations

import json
from typing import Any

from services.envs.base import CallsPerMessage, ToolCall, ToolError

DEFAULT_CALL_ID = "call_0"


def calls_to_run(message: dict[str, Any], rule: CallsPerMessage) -> list[Any]:
    """The raw tool calls of ``message`` that run, in order, under ``rule``: ``all`` of them, the
    ``first``, or (``one``) the only one, a message with several being refused whole."""
    if message.get("invalid_tool_call"):  # the agent's text had a <tool_call> we could not read
        raise ToolError(f"Malformed tool call: {message['invalid_tool_call']}.")
    calls = message.get("tool_calls") or []
    if not isinstance(calls, list) or not calls:
        raise ToolError("No tool call found. Reply with exactly one tool call, using one of the listed tools.")
    if rule == "all":
        return calls
    if rule == "first":  # AgentBench's OS, ALFWorld and WebShop tasks run the first and drop the rest
        return calls[:1]
    if len(calls) > 1:  # running only the first would hide the others from the agent
        raise ToolError(f"{len(calls)} tool calls in one message; none was run. Call exactly one tool per turn.")
    return calls


def first_call_id(message: dict[str, Any]) -> str:
    """The id the reply to a message refused whole answers (its first call's, where it has one)."""
    calls = message.get("tool_calls")
    if isinstance(calls, list) and calls and isinstance(calls[0], dict) and calls[0].get("id"):
        return str(calls[0]["id"])
    return DEFAULT_CALL_ID


def parse_call(call: Any) -> ToolCall:
    """One raw OpenAI tool call as a ``ToolCall``. Raises ToolError with a readable reason."""
    if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
        raise ToolError("Malformed tool call: expected {\"function\": {\"name\": ..., \"arguments\": ...}}.")
    fn = call["function"]
    name, raw_args = fn.get("name"), fn.get("arguments", "{}")
    if not isinstance(name, str) or not name:
        raise ToolError("Malformed tool call: missing function name.")
    if isinstance(raw_args, str):
        try:
            args = json.loads(raw_args) if raw_args.strip() else {}
        except json.JSONDecodeError as exc:
            raise ToolError(f"Malformed tool call: arguments are not valid JSON ({exc.msg}).") from None
    else:
        args = raw_args
    if not isinstance(args, dict):
        raise ToolError("Malformed tool call: arguments must be a JSON object.")
    return ToolCall(name=name, arguments=args)


def call_id_of(call: Any, default: str) -> str:
    return str(call.get("id") or default) if isinstance(call, dict) else default


def malformed(message: dict[str, Any]) -> bool:
    """A tool call that cannot be read: broken ``<tool_call>`` text, or arguments that are not a JSON object."""
    if message.get("invalid_tool_call"):
        return True
    for call in message.get("tool_calls") or []:
        try:
            args = call["function"].get("arguments", "{}")
            if not isinstance(json.loads(args) if isinstance(args, str) else args, dict):
                return True
        except (KeyError, TypeError, AttributeError, json.JSONDecodeError):
            return True
    return False


def check_arguments(tool_schemas: list[dict[str, Any]], call: ToolCall) -> None:
    """Unknown tool, missing or unexpected arguments, wrong JSON types -> ToolError."""
    by_name = {t["function"]["name"]: t["function"] for t in tool_schemas}
    if call.name not in by_name:
        raise ToolError(f"Unknown tool {call.name!r}. Available tools: {', '.join(sorted(by_name))}.")
    params = by_name[call.name].get("parameters", {})
    props: dict[str, Any] = params.get("properties", {})
    missing = [p for p in params.get("required", []) if p not in call.arguments]
    if missing:
        raise ToolError(f"Tool {call.name}: missing argument(s) {', '.join(missing)}.")
    unknown = [a for a in call.arguments if a not in props]
    if unknown:
        raise ToolError(f"Tool {call.name}: unexpected argument(s) {', '.join(unknown)}.")
    json_types = {"string": str, "integer": int, "number": (int, float), "boolean": bool, "array": list,
                  "object": dict}
    for arg, value in call.arguments.items():
        expected = json_types.get(props[arg].get("type", ""))
        if expected and not isinstance(value, expected):
            raise ToolError(f"Tool {call.name}: argument {arg} must be of type {props[arg]['type']}.")
