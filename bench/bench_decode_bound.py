"""What the codec's shape bound costs (``shared.msgshape``): for trajectories of 1k, 8k and 60k tokens with a
10-turn conversation, milliseconds per call (best of 3) of the bound the decoder checks (``bound_error``:
the fields without a schema only), of the whole typed decode (bound included), and of walking every byte
(``shape_error`` on the whole message, what the bound avoids).

    PYTHONPATH=. .venv/bin/python bench/bench_decode_bound.py     # the figures in docs/benchmarks/faults.md
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable

from shared.messages import Trajectory, TurnInfo, decode, encode
from shared.msgshape import bound_error, shape_error


def trajectory(tokens: int, turns: int = 10, seed: int = 0) -> bytes:
    rng = random.Random(seed)
    step = tokens // turns
    messages = [{"role": "system", "content": "You are a SQL agent. " * 40}, {"role": "user", "content": "How many? " * 10}]
    for i in range(turns):
        messages += [{"role": "assistant", "content": "", "tool_calls": [{"id": f"c{i}", "type": "function", "function": {
                        "name": "execute_sql", "arguments": '{"sql": "SELECT COUNT(*) FROM t"}'}}]},
                     {"role": "tool", "tool_call_id": f"c{i}", "content": "[(42,)] " * 20}]
    tools = [{"type": "function", "function": {"name": "execute_sql", "description": "Run SQL.", "parameters": {
        "type": "object", "properties": {"sql": {"type": "string"}}, "required": ["sql"]}}}]
    return encode(Trajectory(
        episode_id="e", group_id="g", task="db", task_id="t", split="train", group_size=8,
        tokens=[rng.randrange(49152) if rng.random() > 0.1 else rng.randrange(128) for _ in range(tokens)],
        logprobs=[-rng.random() for _ in range(tokens)], loss_mask=[rng.randrange(2) for _ in range(tokens)],
        prompt_len=10, turns=[TurnInfo(start=i * step, end=(i + 1) * step, engine_id="rollout-0", policy_version=3)
                              for i in range(turns)],
        reward=1.0, status="completed", replica_id="r", messages=messages, tools=tools))


def best_ms(call: Callable[[], object], repeat: int) -> float:
    best = float("inf")
    for _ in range(3):
        started = time.perf_counter()
        for _ in range(repeat):
            call()
        best = min(best, (time.perf_counter() - started) / repeat * 1e3)
    return round(best, 3)


def main() -> None:
    for tokens in (1024, 8192, 60_000):
        data = trajectory(tokens)
        row = {"tokens": tokens, "bytes": len(data),
               "bound_ms": best_ms(lambda d=data: bound_error(d, Trajectory), 50),
               "decode_ms": best_ms(lambda d=data: decode(d, Trajectory), 50),
               "walk_every_byte_ms": best_ms(lambda d=data: shape_error(d), 5)}
        row["bound_share_of_decode"] = round(row["bound_ms"] / row["decode_ms"], 3)
        print(json.dumps(row))


if __name__ == "__main__":
    main()
