"""Trajectories as dataset rows, in the Hugging Face chat format, and the files that hold them.

One row per episode:

* ``messages``: the conversation as the OpenAI API writes it: ``system`` / ``user`` turns, ``assistant``
  turns with ``tool_calls`` (``[{"id", "type": "function", "function": {"name", "arguments": "<JSON>"}}]``),
  ``tool`` turns answering one call (``tool_call_id``). Each assistant turn also names the engine that
  wrote it and its policy version (``engine_id``, ``policy_version``; -1 for the env's oracle or an
  API model);
* ``tools``: the episode's tool schemas (OpenAI function-calling form): a list in JSONL, a JSON string in
  Parquet (a column must have one type, and every task's schemas differ);
* ``reward``, ``status``, ``task``, ``task_id``, ``split``, ``level``, ``task_kind``, ``episode_id``,
  ``group_id``, ``num_turns``, ``temperature``, ``created_at`` and ``metrics`` (a JSON string in Parquet);
* with ``tokens=True`` also ``tokens``, ``logprobs``, ``loss_mask``, ``prompt_len`` and ``turns`` (each
  turn's token span with its engine and version): the exact token-in/token-out record.

A file is written as it is read (``RowWriter``): JSONL a line per row, Parquet a row group every
``ROW_GROUP_BYTES`` of input, so an export of any size holds one row group in memory.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from jetrl.errors import CliError
from shared.messages import Trajectory

ROW_GROUP_BYTES = 8 * 1024 * 1024
"""A Parquet row group is written once the rows buffered for it came from about this many bytes of messages
(``encoded_size``); as Python objects they take a few times more."""
ROW_GROUP_ROWS = 4096
"""... or once it holds this many rows."""
FORMATS = ("parquet", "jsonl")
OPENAI_KEYS = ("role", "content", "tool_calls", "tool_call_id", "name")


def _text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, list):  # OpenAI content parts: the text ones
        return "".join(str(p.get("text", "")) for p in content if isinstance(p, dict) and p.get("type") == "text")
    return str(content)


def _tool_call(call: dict[str, Any], turn: int, k: int) -> dict[str, Any]:
    fn = call.get("function") or {}
    arguments = fn.get("arguments", "{}")
    return {"id": str(call.get("id") or f"call_{turn}_{k}"), "type": "function",
            "function": {"name": str(fn.get("name", "")),
                         "arguments": arguments if isinstance(arguments, str) else json.dumps(arguments)}}


def chat_messages(traj: Trajectory) -> list[dict[str, Any]]:
    """The trajectory's conversation in the OpenAI shape, each assistant turn with its engine and version.
    Keys the API does not have (the rollout's ``invalid_tool_call`` note) are left out."""
    out, turn = [], 0
    for m in traj.messages:
        role = str(m.get("role", ""))
        row: dict[str, Any] = {"role": role, "content": _text(m.get("content"))}
        if role == "assistant":
            calls = m.get("tool_calls") or []
            if calls:
                row["tool_calls"] = [_tool_call(c, turn, k) for k, c in enumerate(calls) if isinstance(c, dict)]
            info = traj.turns[turn] if turn < len(traj.turns) else None
            row["engine_id"] = info.engine_id if info else ""
            row["policy_version"] = info.policy_version if info else -1
            turn += 1
        elif role == "tool":
            row["tool_call_id"] = str(m.get("tool_call_id") or "")
        if m.get("name"):
            row["name"] = str(m["name"])
        out.append(row)
    return out


def trajectory_row(traj: Trajectory, tokens: bool = False) -> dict[str, Any]:
    """One dataset row (JSONL's form: ``tools`` a list, ``metrics`` a map)."""
    row: dict[str, Any] = {
        "episode_id": traj.episode_id, "group_id": traj.group_id, "task": traj.task, "task_id": traj.task_id,
        "split": traj.split, "level": traj.level, "task_kind": traj.task_kind,
        "messages": chat_messages(traj), "tools": traj.tools, "reward": traj.reward, "status": traj.status,
        "num_turns": len(traj.turns), "temperature": traj.temperature, "created_at": traj.created_at,
        "metrics": traj.metrics,
    }
    if tokens:
        row.update(tokens=traj.tokens, logprobs=traj.logprobs, loss_mask=traj.loss_mask, prompt_len=traj.prompt_len,
                   turns=[{"start": t.start, "end": t.end, "engine_id": t.engine_id,
                           "policy_version": t.policy_version} for t in traj.turns])
    return row


def encoded_size(traj: Trajectory) -> int:
    """About the bytes of a trajectory's message (msgpack: ~13 a token with its logprob and mask), for row
    groups of a bounded size without encoding it again."""
    return 13 * len(traj.tokens) + sum(len(_text(m.get("content"))) for m in traj.messages) + 1024


def parquet_schema(tokens: bool) -> Any:
    import pyarrow as pa

    call = pa.struct([("id", pa.string()), ("type", pa.string()),
                      ("function", pa.struct([("name", pa.string()), ("arguments", pa.string())]))])
    message = pa.struct([("role", pa.string()), ("content", pa.string()), ("tool_calls", pa.list_(call)),
                         ("tool_call_id", pa.string()), ("name", pa.string()), ("engine_id", pa.string()),
                         ("policy_version", pa.int64())])
    fields = [("episode_id", pa.string()), ("group_id", pa.string()), ("task", pa.string()), ("task_id", pa.string()),
              ("split", pa.string()), ("level", pa.int32()), ("task_kind", pa.string()),
              ("messages", pa.list_(message)), ("tools", pa.string()), ("reward", pa.float64()),
              ("status", pa.string()), ("num_turns", pa.int32()), ("temperature", pa.float64()),
              ("created_at", pa.float64()), ("metrics", pa.string())]
    if tokens:
        turn = pa.struct([("start", pa.int32()), ("end", pa.int32()), ("engine_id", pa.string()),
                          ("policy_version", pa.int64())])
        fields += [("tokens", pa.list_(pa.int32())), ("logprobs", pa.list_(pa.float32())),
                   ("loss_mask", pa.list_(pa.int8())), ("prompt_len", pa.int32()), ("turns", pa.list_(turn))]
    return pa.schema(fields)


class RowWriter:
    """Rows to a JSONL or Parquet file as they come; ``close`` finishes the file (Parquet's footer)."""

    def __init__(self, path: str | Path, fmt: str, tokens: bool = False) -> None:
        if fmt not in FORMATS:
            raise ValueError(f"unknown format {fmt!r} ({' | '.join(FORMATS)})")
        self.path, self.fmt, self.tokens = Path(path), fmt, tokens
        self.rows = 0
        self._buffer: list[dict[str, Any]] = []
        self._buffered_bytes = 0
        self._jsonl: IO[str] | None = None
        self._parquet: Any = None
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if fmt == "jsonl":
            self._jsonl = open(self.path, "w", encoding="utf-8")
        else:
            import pyarrow.parquet as pq

            self._schema = parquet_schema(tokens)
            self._parquet = pq.ParquetWriter(self.path, self._schema, compression="zstd")

    def write(self, row: dict[str, Any], size_hint: int = 0) -> None:
        self.rows += 1
        if self._jsonl is not None:
            self._jsonl.write(json.dumps(row, ensure_ascii=False) + "\n")
            return
        self._buffer.append(dict(row, tools=json.dumps(row["tools"], ensure_ascii=False),
                                 metrics=json.dumps(row["metrics"])))
        self._buffered_bytes += size_hint
        if self._buffered_bytes >= ROW_GROUP_BYTES or len(self._buffer) >= ROW_GROUP_ROWS:
            self._flush()

    def _flush(self) -> None:
        if self._buffer:
            import pyarrow as pa

            self._parquet.write_table(pa.Table.from_pylist(self._buffer, schema=self._schema))
            self._buffer, self._buffered_bytes = [], 0

    def close(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None
        if self._parquet is not None:
            self._flush()
            self._parquet.close()
            self._parquet = None


def format_of(path: str | Path, fmt: str | None = None) -> str:
    """``fmt``, else the file's suffix (``.parquet`` / ``.jsonl``)."""
    if fmt:
        return fmt
    suffix = Path(path).suffix.lower().lstrip(".")
    if suffix in ("jsonl", "json", "ndjson"):
        return "jsonl"
    if suffix in ("parquet", "pq"):
        return "parquet"
    raise ValueError(f"{path}: cannot tell the format from the suffix; name it .parquet or .jsonl, or give --format")


# ---------------------------------------------------------------------------- reading a dataset file
@dataclass
class Conversation:
    """One row of a chat dataset, ours or another with OpenAI-shaped tool calls."""

    row: int
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]]
    reward: float = 1.0
    status: str = "completed"
    task: str = "data"
    task_id: str = ""


class DatasetError(CliError, ValueError):
    """A dataset row that is not a chat conversation: the message names the row and the field."""


def _as_list(value: Any, what: str, row: int) -> list[Any]:
    if value is None:
        return []
    if isinstance(value, str):  # Parquet keeps tools as JSON text; other datasets do the same
        try:
            value = json.loads(value) if value.strip() else []
        except json.JSONDecodeError as exc:
            raise DatasetError(f"row {row}: {what} is a string that is not JSON ({exc.msg})") from None
    if hasattr(value, "tolist"):  # numpy arrays from pandas
        value = value.tolist()
    if not isinstance(value, list):
        raise DatasetError(f"row {row}: {what} must be a list, got {type(value).__name__}")
    return value


def conversation(record: dict[str, Any], row: int) -> Conversation:
    """A dataset record as a Conversation, checked: a list of messages with known roles, tool calls in the
    OpenAI shape. Absent fields (reward, task, ...) take their defaults; a conversation without an
    assistant turn has nothing to train on and is refused."""
    if "messages" not in record:
        raise DatasetError(f"row {row}: no 'messages' field (columns: {', '.join(sorted(record)) or 'none'})")
    messages = []
    for i, m in enumerate(_as_list(record["messages"], "messages", row)):
        if not isinstance(m, dict):
            raise DatasetError(f"row {row}: messages[{i}] must be a map, got {type(m).__name__}")
        m = {k: v for k, v in m.items() if v is not None}
        if m.get("role") not in ("system", "user", "assistant", "tool"):
            raise DatasetError(f"row {row}: messages[{i}].role {m.get('role')!r} is not system, user, assistant "
                               "or tool")
        calls = _as_list(m.get("tool_calls"), f"messages[{i}].tool_calls", row)
        for k, call in enumerate(calls):
            fn = call.get("function") if isinstance(call, dict) else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                raise DatasetError(f"row {row}: messages[{i}].tool_calls[{k}] must be "
                                   '{"type": "function", "function": {"name": ..., "arguments": ...}}')
            arguments = fn.get("arguments") or "{}"
            if isinstance(arguments, str):
                try:
                    json.loads(arguments)
                except json.JSONDecodeError as exc:
                    raise DatasetError(f"row {row}: messages[{i}].tool_calls[{k}].function.arguments is not "
                                       f"JSON ({exc.msg})") from None
        if calls:
            m["tool_calls"] = calls
        else:
            m.pop("tool_calls", None)
        m["content"] = _text(m.get("content"))
        messages.append(m)
    if not any(m["role"] == "assistant" for m in messages):
        raise DatasetError(f"row {row}: no assistant turn to train on")
    tools = _as_list(record.get("tools"), "tools", row)
    reward = record.get("reward")
    return Conversation(row=row, messages=messages, tools=tools,
                        reward=1.0 if reward is None else float(reward),
                        status=str(record.get("status") or "completed"), task=str(record.get("task") or "data"),
                        task_id=str(record.get("task_id") or row))


def read_records(path: str | Path, fmt: str | None = None, batch_rows: int = 256) -> Iterator[dict[str, Any]]:
    """The records of a JSONL or Parquet file, one at a time (Parquet a batch of rows at a time)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such dataset file")
    if format_of(path, fmt) == "jsonl":
        with open(path, encoding="utf-8") as fh:
            for n, line in enumerate(fh):
                if line.strip():
                    try:
                        yield json.loads(line)
                    except json.JSONDecodeError as exc:
                        raise DatasetError(f"{path}: line {n + 1} is not JSON ({exc.msg})") from None
        return
    import pyarrow.parquet as pq

    for batch in pq.ParquetFile(path).iter_batches(batch_size=batch_rows):
        yield from batch.to_pylist()


def read_conversations(path: str | Path, fmt: str | None = None) -> Iterator[Conversation]:
    for row, record in enumerate(read_records(path, fmt)):
        yield conversation(record, row)
