"""Play db episodes with a model directory in one process and print what the policy writes.

    python bench/probe_db_policy.py MODEL_DIR [--split train|test] [--tasks N] [--temperature T]

Greedy by default. No services: the db env in process, ChatML rendering and tool-call parsing from
``shared/chat.py``, the same stop token and turn limit of 96 new tokens as the rollout. It is
how the warm-start checkpoints of docs/history.md (learning benchmark, round 3) were looked at by hand; a
checkpoint directory (``model.safetensors`` only) needs the config and tokenizer files of the model it
came from copied beside it.
"""

from __future__ import annotations

import argparse
import json

import torch

from services.envs.base import ToolCall, ToolError
from services.envs.db import make_env
from services.envs.db.config import DBTaskConfig
from shared.chat import parse_assistant, render_observation, render_opening
from shared.config import EnvConfig
from shared.model import load_model, load_tokenizer, quiet_transformers


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model")
    p.add_argument("--split", default="test")
    p.add_argument("--tasks", type=int, default=8, help="the first N tasks of the split")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--num-train-tasks", type=int, default=768, help="env.num_train_tasks of the run")
    p.add_argument("--num-test-tasks", type=int, default=96, help="env.num_test_tasks of the run")
    p.add_argument("--levels", default="1,2", help="env.db.levels of the run (configs/learning.toml: 1,2)")
    p.add_argument("--max-turns", type=int, default=4)
    args = p.parse_args()
    quiet_transformers()
    torch.set_num_threads(1)
    tok, model = load_tokenizer(args.model), load_model(args.model).eval()
    env = make_env(EnvConfig(num_train_tasks=args.num_train_tasks, num_test_tasks=args.num_test_tasks,
                             sections={"db": DBTaskConfig(levels=[int(x) for x in args.levels.split(",")])}))
    stop = [tok.convert_tokens_to_ids("<|im_end|>")]
    sampling = dict(do_sample=True, temperature=args.temperature, top_k=0) if args.temperature > 0 else \
        dict(do_sample=False)
    wins = 0
    task_ids = env.task_ids(args.split)[: args.tasks]
    for task_id in task_ids:
        task = env.task(task_id, args.split)
        episode = env.open(task_id, args.split, 0)
        ids = tok(render_opening(episode.opening(), episode.tools))["input_ids"]
        print(f"===== {task_id} {task.description} | reference: {task.ref_sql}")
        for turn in range(args.max_turns):
            x = torch.tensor([ids])
            with torch.no_grad():
                out = model.generate(input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=96,
                                     eos_token_id=stop, pad_token_id=tok.pad_token_id, **sampling)
            new = out[0, len(ids):].tolist()
            ids += new
            text = tok.decode(new)
            print(f"  [{turn}] {text!r}")
            message = parse_assistant(text, turn)
            if not message.get("tool_calls"):
                print("  -> no tool call")
                break
            fn = message["tool_calls"][0]["function"]
            try:
                result = episode.call(ToolCall(fn["name"], json.loads(fn["arguments"])))
            except ToolError as exc:
                print(f"  -> tool error: {exc}")
                break
            print(f"  -> {result.content[:150]!r} finish={result.finish} reward={result.reward}")
            if result.finish:
                wins += result.reward >= 1.0
                break
            ids += tok(render_observation([{"role": "tool", "content": result.content}]))["input_ids"]
        episode.close()
    print(f"success {wins} / {len(task_ids)}")


if __name__ == "__main__":
    main()
