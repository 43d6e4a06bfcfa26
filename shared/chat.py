"""ChatML prompt pieces and tool-call parsing, token-in/token-out.

The history is never re-tokenised: the opening is rendered once, each turn appends exactly the token
ids the engine sampled, and each observation appends the token ids of its own ChatML block. So the
trainer scores the very tokens the behaviour policy produced.

Tools are described in the system message the way Qwen2.5 does (``<tools>`` JSON, answers in
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``); tool results come back as a user turn
wrapping ``<tool_response>``. This works with any ChatML template (Qwen2, SmolLM2).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

TOOL_CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)

TOOLS_PREAMBLE = (
    "\n\n# Tools\n\nYou may call one function per turn to help with the task. The available functions "
    "are described in JSON Schema within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a JSON object with the function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n{{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}}\n</tool_call>"
)


COMPACT_PREAMBLE = (
    "\n\n# Tools\nCall exactly one tool per turn, as <tool_call>{{\"name\": ..., \"arguments\": {{...}}}}</tool_call>\n"
    "{tools}"
)


def _block(role: str, content: str) -> str:
    return f"<|im_start|>{role}\n{content}<|im_end|>\n"


def _type_of(schema: dict[str, Any]) -> str:
    kind = schema.get("type", "any")
    if "enum" in schema:
        return " | ".join(json.dumps(v) for v in schema["enum"])
    if kind == "array":
        return f"list of {_type_of(schema.get('items', {}))}"
    return str(kind)


def compact_tool(tool: dict[str, Any]) -> str:
    """One line per tool: ``- name(arg: type, opt?: type): description``; argument descriptions follow
    in brackets where the schema has them. Same names and arguments as the JSON schema, ~4x fewer tokens."""
    fn = tool.get("function", tool)
    params = fn.get("parameters") or {}
    required = set(params.get("required") or [])
    args, notes = [], []
    for name, schema in (params.get("properties") or {}).items():
        args.append(f"{name}{'' if name in required else '?'}: {_type_of(schema)}")
        if schema.get("description"):
            notes.append(f"{name}: {schema['description']}")
    line = f"- {fn['name']}({', '.join(args)}): {fn.get('description', '').strip()}"
    return line + (f" [{'; '.join(notes)}]" if notes else "")


def render_opening(messages: list[dict[str, Any]], tools: list[dict[str, Any]], tool_format: str = "json") -> str:
    """The prompt text up to and including the first ``<|im_start|>assistant\\n``. ``tool_format``:
    ``json`` (the tools' JSON schemas, as Qwen2.5 renders them) or ``compact`` (one line per tool)."""
    if tool_format == "compact":
        preamble = COMPACT_PREAMBLE.format(tools="\n".join(compact_tool(t) for t in tools))
    elif tool_format == "json":
        preamble = TOOLS_PREAMBLE.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))
    else:
        raise ValueError(f"unknown tool format {tool_format!r} (json | compact)")
    out, has_system = [], False
    for m in messages:
        content = str(m.get("content") or "")
        if m["role"] == "system":
            content += preamble
            has_system = True
        elif m["role"] == "assistant" and m.get("tool_calls"):  # an example conversation (a task's one-shot example)
            content = render_tool_call(m)
        elif m["role"] == "tool":  # rendered as an observation is after a call
            out.append(_block("user", f"<tool_response>\n{content}\n</tool_response>"))
            continue
        out.append(_block(m["role"], content))
    if not has_system:
        out.insert(0, _block("system", "You are a helpful agent." + preamble))
    return "".join(out) + "<|im_start|>assistant\n"


def render_observation(messages: list[dict[str, Any]]) -> str:
    """Tool results (and any user text) after an assistant turn ending in ``<|im_end|>``, up to the
    next ``<|im_start|>assistant\\n``. Starts with the newline ChatML puts after ``<|im_end|>``."""
    parts = []
    for m in messages:
        if m["role"] == "tool":
            parts.append(f"<tool_response>\n{m.get('content', '')}\n</tool_response>")
        else:
            parts.append(str(m.get("content") or ""))
    return "\n" + _block("user", "\n".join(parts)) + "<|im_start|>assistant\n"


def parse_assistant(text: str, turn: int) -> dict[str, Any]:
    """OpenAI-format assistant message from generated text. A ``<tool_call>`` whose JSON is broken is
    passed on as ``invalid_tool_call`` so the env answers with a clear error observation; several
    ``<tool_call>``s are all passed on (ids ``call_<turn>``, then ``call_<turn>_<k>``): which of them run is the
    episode's rule (``Episode.calls_per_message``; some episodes read the whole message)."""
    matches = TOOL_CALL.findall(text)
    content = TOOL_CALL.sub("", text).strip()
    message: dict[str, Any] = {"role": "assistant", "content": content}
    calls = []
    for k, raw in enumerate(matches):
        where = f"tool call {k + 1} of {len(matches)}: " if len(matches) > 1 else ""
        try:
            call = json.loads(raw.strip())
        except json.JSONDecodeError as exc:
            message["invalid_tool_call"] = f"{where}the text inside <tool_call> is not valid JSON ({exc.msg} at char {exc.pos})"
            return message
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            message["invalid_tool_call"] = f'{where}expected {{"name": <function-name>, "arguments": {{...}}}} inside <tool_call>'
            return message
        arguments = call.get("arguments", {})
        calls.append({
            "id": f"call_{turn}" if k == 0 else f"call_{turn}_{k}", "type": "function",
            "function": {"name": call["name"],
                         "arguments": arguments if isinstance(arguments, str) else json.dumps(arguments)},
        })
    if calls:
        message["tool_calls"] = calls
    return message


def render_tool_call(message: dict[str, Any]) -> str:
    """Text of an assistant message in our format (used to tokenise oracle demonstrations)."""
    parts = [message.get("content") or ""]
    for call in message.get("tool_calls") or []:
        fn = call["function"]
        args = fn["arguments"]
        args = json.loads(args) if isinstance(args, str) and args.strip() else (args or {})
        parts.append("<tool_call>\n" + json.dumps({"name": fn["name"], "arguments": args}, ensure_ascii=False)
                     + "\n</tool_call>")
    return "\n".join(p for p in parts if p)


def text_of(content: Any) -> str:
    """An OpenAI ``content``: a string, ``None``, or a list of parts of which the text ones count."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(str(p.get("text", "")) for p in content if isinstance(p, dict) and p.get("type") == "text")
    return str(content)


def render_chat(messages: list[dict[str, Any]], tools: list[dict[str, Any]], tool_format: str = "json") -> str:
    """A whole OpenAI conversation as the prompt text the rollout builds turn by turn, ending in
    ``<|im_start|>assistant\\n``: the opening (system and user messages up to the first assistant one,
    with the tools in the system prompt), then each assistant message as the text the engine would have
    sampled (``render_tool_call``) closed by ``<|im_end|>``, and each run of tool / user messages as one
    observation block (``render_observation``). So a policy served over the API sees exactly the
    format it was trained on. Without tools there is no tools preamble."""
    messages = [dict(m, content=text_of(m.get("content"))) for m in messages]
    first = next((i for i, m in enumerate(messages) if m["role"] == "assistant"), len(messages))
    if tools:
        out = render_opening(messages[:first], tools, tool_format)
    else:
        out = "".join(_block(m["role"], m["content"]) for m in messages[:first]) + "<|im_start|>assistant\n"
    pending: list[dict[str, Any]] = []  # tool / user messages since the last assistant turn
    for m in messages[first:]:
        if m["role"] == "assistant":
            if pending:
                out += render_observation(pending)
                pending = []
            out += render_tool_call(m) + "<|im_end|>"
        else:
            pending.append(m)
    if pending:
        return out + render_observation(pending)
    # the conversation ended on an assistant message (or had none after the opening)
    return out + ("\n<|im_start|>assistant\n" if first < len(messages) else "")


@dataclass
class TokenizedConversation:
    """A conversation as the rollout's token record: the opening once, each assistant turn as the tokens an
    engine would have sampled (its text, then ``<|im_end|>``), each run of tool / user messages as one
    observation; ``loss_mask`` marks the assistant turns, ``turns`` their spans."""

    tokens: list[int]
    loss_mask: list[int]
    prompt_len: int
    turns: list[tuple[int, int]]


def tokenize_conversation(messages: list[dict[str, Any]], tools: list[dict[str, Any]], tokenizer: Any,
                          tool_format: str = "json") -> TokenizedConversation:
    """The tokens the rollout would have recorded for this conversation, turn by turn as it builds them
    (``RolloutWorker.play``: the oracle's turns are exactly these), so a demonstration from a file trains
    the same tokens and loss mask as one played through the envs. What follows the last assistant turn
    (the env's last answer) is left out, as the rollout leaves it out."""
    messages = [dict(m, content=text_of(m.get("content"))) for m in messages]
    first = next((i for i, m in enumerate(messages) if m["role"] == "assistant"), len(messages))
    end_of_turn = tokenizer.convert_tokens_to_ids("<|im_end|>")
    tokens = tokenizer.encode(render_opening(messages[:first], tools, tool_format), add_special_tokens=False)
    mask = [0] * len(tokens)
    prompt_len, turns = len(tokens), []
    pending: list[dict[str, Any]] = []
    for m in messages[first:]:
        if m["role"] != "assistant":
            pending.append(m)
            continue
        if pending:
            observation = tokenizer.encode(render_observation(pending), add_special_tokens=False)
            tokens += observation
            mask += [0] * len(observation)
            pending = []
        turn = tokenizer.encode(render_tool_call(m), add_special_tokens=False) + [end_of_turn]
        turns.append((len(tokens), len(tokens) + len(turn)))
        tokens += turn
        mask += [1] * len(turn)
    return TokenizedConversation(tokens=tokens, loss_mask=mask, prompt_len=prompt_len, turns=turns)
