"""Prompt rendering and tool-call parsing of the rollout (token-in/token-out relies on these)."""

from __future__ import annotations

import json

import pytest

from shared.chat import parse_assistant, render_observation, render_opening, render_tool_call

TOOLS = [{"type": "function", "function": {"name": "execute_sql", "description": "run SQL",
                                            "parameters": {"type": "object", "properties": {"sql": {"type": "string"}},
                                                           "required": ["sql"]}}}]


def test_opening_puts_tools_in_the_system_turn_and_ends_with_assistant_prompt() -> None:
    text = render_opening([{"role": "system", "content": "You are a DB agent."},
                           {"role": "user", "content": "How many rows?"}], TOOLS)
    assert text.startswith("<|im_start|>system\nYou are a DB agent.")
    assert '"name": "execute_sql"' in text and "<tools>" in text
    assert text.endswith("<|im_start|>user\nHow many rows?<|im_end|>\n<|im_start|>assistant\n")
    # no system message given: one is added so the tools are still described
    assert render_opening([{"role": "user", "content": "x"}], TOOLS).startswith("<|im_start|>system\n")


def test_parse_valid_call() -> None:
    msg = parse_assistant('Let me look.\n<tool_call>\n{"name": "execute_sql", "arguments": {"sql": "SELECT 1"}}\n'
                          '</tool_call>', turn=2)
    assert msg["content"] == "Let me look."
    call = msg["tool_calls"][0]
    assert call["id"] == "call_2" and call["function"]["name"] == "execute_sql"
    assert json.loads(call["function"]["arguments"]) == {"sql": "SELECT 1"}


def test_parse_broken_calls_are_flagged_not_dropped() -> None:
    msg = parse_assistant('<tool_call>{"name": "execute_sql", "arguments": {"sql": </tool_call>', turn=0)
    assert "tool_calls" not in msg and "not valid JSON" in msg["invalid_tool_call"]
    msg = parse_assistant('<tool_call>["execute_sql"]</tool_call>', turn=0)
    assert "expected" in msg["invalid_tool_call"]
    # generation cut off before </tool_call>: still parsed when the JSON is complete
    msg = parse_assistant('<tool_call>{"name": "f", "arguments": {}}', turn=0)
    assert msg["tool_calls"][0]["function"]["name"] == "f"
    assert parse_assistant("just text", turn=0) == {"role": "assistant", "content": "just text"}


def test_observation_block_and_round_trip_of_a_demonstration() -> None:
    obs = render_observation([{"role": "tool", "tool_call_id": "call_0", "content": "[(1,)]"}])
    assert obs == ("\n<|im_start|>user\n<tool_response>\n[(1,)]\n</tool_response><|im_end|>\n"
                   "<|im_start|>assistant\n")
    message = {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "execute_sql", "arguments": '{"sql": "SELECT 2"}'}}]}
    back = parse_assistant(render_tool_call(message), turn=0)
    assert back["tool_calls"][0]["function"]["name"] == "execute_sql"
    assert json.loads(back["tool_calls"][0]["function"]["arguments"]) == {"sql": "SELECT 2"}


def test_compact_tool_format_keeps_every_name_and_argument_in_fewer_tokens() -> None:
    tools = TOOLS + [{"type": "function", "function": {
        "name": "commit", "description": "Commit answers.",
        "parameters": {"type": "object", "properties": {
            "answers": {"type": "array", "items": {"type": "string"}, "description": "the answers"},
            "mode": {"type": "string", "enum": ["a", "b"]}}, "required": ["answers"]}}}]
    messages = [{"role": "system", "content": "Act."}, {"role": "user", "content": "Go."}]
    compact = render_opening(messages, tools, "compact")
    assert "- execute_sql(sql: string): run SQL" in compact
    assert '- commit(answers: list of string, mode?: "a" | "b"): Commit answers. [answers: the answers]' in compact
    assert compact.endswith("<|im_start|>user\nGo.<|im_end|>\n<|im_start|>assistant\n")
    assert len(compact) < len(render_opening(messages, tools, "json")) / 1.5
    with pytest.raises(ValueError, match="tool format"):
        render_opening(messages, tools, "yaml")
