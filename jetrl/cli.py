"""``jetrl``: run everything on one machine, watch episodes live, ask for status.

    jetrl quickstart [--config FILE] [--fresh]   # cached warm start, then RL that improves it
    jetrl up [--config FILE] [--rollouts N] [--section.key=value ...]
    jetrl sft [--config FILE] [...]     # warm start on oracle demonstrations -> <run>/model
    jetrl sft --data FILE [...]         # warm start on a chat dataset (jetrl export's, or any) -> <run>/model
    jetrl eval [--config FILE] [...]    # test split, greedy, per-task report -> <run>/eval.json
    jetrl eval --engine openai --base-url URL --model NAME   # the same, any OpenAI-compatible server
    jetrl eval --suite TASK [...]       # one task alone (an eval-only benchmark task), per-category accuracy
    jetrl serve [--config FILE] [...]   # the policy over the OpenAI API, following weight broadcasts
    jetrl probe [--config FILE] [...]   # eval, greedy and sampled, per task / level / kind
    jetrl watch [--run-dir DIR | --url NATS_URL --prefix P] [--task T] [--events]
    jetrl status [--run-dir DIR]
    jetrl creds observer [--run-dir DIR]   # read-only NATS credentials for outside readers (context file, URL)
    jetrl export [--run-dir DIR | --url NATS_URL --prefix P] -o FILE.parquet|.jsonl [filters]   # docs/data.md
    jetrl reverify [--run-dir DIR] [--task T] [--section.key=value ...]   # grade stored episodes again
    jetrl config [--task T]   # every config key with its default and help; with a task, only
                              # what its env service reads: [env] and [env.<task>]
    jetrl config --markdown [--check]   # the config reference page, docs/reference/config.md
    jetrl env-check TASK [--config FILE]   # a task's env against the env contract: oracle, bad calls, cancel
    jetrl topology [--config FILE]   # declare streams and buckets as the NATS admin (compose)
    jetrl secrets [--env compose/.env] [--replicas rollout=N]   # compose's NATS users (one per role and
                                        # per replica), status API token, signing keys
    jetrl schema [--check]   # message schemas (docs/schemas/) and the env protocol's field tables

``up`` starts an embedded nats-server (unless ``nats.url`` is set) and every service as its own
process (``python -m services.<role>``), prints one progress line per training step, and stops
everything when the trainer is done or on Ctrl-C. A service that dies (the embedded nats-server
too) is restarted with a backoff and counted; only a crash loop ends the run (``[supervisor]``).
A run directory holding an earlier run is kept under a new name unless ``--resume``. Children get
SIGTERM if this process dies (PR_SET_PDEATHSIG), so nothing is left behind.
"""

from __future__ import annotations

import argparse
import sys

from jetrl.access import cmd_creds
from jetrl.compose_secrets import cmd_secrets
from jetrl.configref import add_arguments as add_configref_arguments
from jetrl.configref import run as run_configref
from jetrl.envcheck import cmd_env_check
from jetrl.errors import run_cli
from jetrl.export import add_arguments as add_export_arguments
from jetrl.export import cmd_export
from jetrl.launch import MODE_DEFAULTS, launch
from jetrl.quickstart import cmd_quickstart
from jetrl.reverify import add_arguments as add_reverify_arguments
from jetrl.reverify import cmd_reverify
from jetrl.schema import add_arguments as add_schema_arguments
from jetrl.schema import run as run_schema
from jetrl.serve import cmd_serve
from jetrl.status import cmd_status
from jetrl.topology import cmd_topology
from jetrl.watch import cmd_watch
from shared.config import describe, load_config
from shared.log import setup_logging


def main(argv: list[str] | None = None) -> int:
    """The ``jetrl`` command: a user's mistake is one ``jetrl: error:`` line (``--debug``: the traceback)."""
    return run_cli(_main, sys.argv[1:] if argv is None else argv)


def _main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="jetrl", description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, text in (("up", "start NATS and every service; train; stop everything"),
                       ("sft", "warm start: supervised training on each env's oracle demonstrations"),
                       ("eval", "run the test split of every task (greedy) and report per-task figures"),
                       ("probe", "eval greedy and sampled (k = controller.eval_samples): success and well-formed "
                                 "tool calls per task, level and kind")):
        p = sub.add_parser(name, help=text)
        p.add_argument("--config", default=None)
        p.add_argument("--rollouts", type=int, default=2, help="rollout replicas")
        p.add_argument("--env-replicas", type=int, default=1, help="replicas per task env")
        p.add_argument("--stale-engines", type=int, default=0,
                       help="extra pool engines that take new weights every rollout.stale_every versions "
                            "(used when rollout.cross_policy_prob > 0)")
        p.add_argument("--trainer-ranks", type=int, default=1,
                       help="data-parallel trainer ranks on this host (DeepSpeed ZeRO under torchrun; needs "
                            "`make venv-deepspeed`); 1 = the plain one-process trainer")
        p.add_argument("--resume", action="store_true",
                       help="continue the run in run.dir (its checkpoints and streams); without it an earlier "
                            "run there is renamed and a fresh one starts")
        if name == "sft":
            p.add_argument("--data", default=None, help="demonstrations from this dataset file (.parquet / .jsonl: "
                                                        "jetrl export's, or any chat dataset with OpenAI tool calls) "
                                                        "instead of the envs' oracles")
        if name in ("eval", "probe"):
            p.add_argument("--engine", default=None, help="rollout.engine: continuous | hf | vllm | openai")
            p.add_argument("--base-url", default=None, help="openai engine: the server, e.g. http://host:8001/v1")
            p.add_argument("--model", default=None, help="openai engine: the model name the server knows")
            p.add_argument("--suite", default=None, help="one task alone instead of run.tasks (an "
                                                          "eval-only benchmark task)")
    serve = sub.add_parser("serve", help="the policy over the OpenAI chat-completions API, following weight "
                                         "broadcasts (--config of a running training run)")
    serve.add_argument("--config", default=None)
    watch = sub.add_parser("watch", help="print live trajectories (and with --events every action/observation)")
    watch.add_argument("--run-dir", default="runs/latest")
    watch.add_argument("--url", default=None)
    watch.add_argument("--prefix", default=None)
    watch.add_argument("--task", default=None)
    watch.add_argument("--events", action="store_true")
    watch.add_argument("--seconds", type=float, default=0, help="stop after this long (0 = until Ctrl-C)")
    quick = sub.add_parser("quickstart", help="a warm start built once and cached, then RL that improves it")
    quick.add_argument("--config", default="configs/quickstart.toml")
    quick.add_argument("--rollouts", type=int, default=1, help="rollout replicas")
    quick.add_argument("--env-replicas", type=int, default=1, help="replicas per task env")
    quick.add_argument("--stale-engines", type=int, default=0, help="extra stale pool engines")
    quick.add_argument("--fresh", action="store_true", help="rebuild the warm start even if one is cached")
    creds = sub.add_parser("creds", help="read-only NATS credentials of a run for outside tools: a context file "
                                         "and a URL")
    creds.add_argument("role", choices=["observer"], help="observer: reads streams, publishes nothing")
    creds.add_argument("--run-dir", default="runs/latest")
    status = sub.add_parser("status", help="the controller's /status of a run")
    status.add_argument("--run-dir", default="runs/latest")
    config = sub.add_parser("config", help="every config key with its default and help")
    config.add_argument("--task", default=None, help="only what this task's env service reads: [env] and "
                                                     "[env.<task>] (any registered task)")
    config.add_argument("--config", default=None, help="a config whose [env.<task>] factory names the task")
    add_configref_arguments(config)
    env_check = sub.add_parser("env-check", help="check a task's env against the env contract (oracle per split, bad "
                                                 "calls, cancel, health) over a real nats-server; exit 1 on a failure")
    env_check.add_argument("task")
    env_check.add_argument("--config", default=None)
    env_check.add_argument("--episodes", type=int, default=2, help="oracle episodes per split")
    env_check.add_argument("--wait", type=float, default=600.0,
                           help="seconds to wait for the env to answer (a first start may build its task data)")
    topology = sub.add_parser("topology", help="declare every stream and bucket as the NATS admin user "
                                                "(authenticated servers: the services wait for it)")
    topology.add_argument("--config", default=None)
    secrets_cmd = sub.add_parser("secrets", help="random NATS passwords per role and a status API token, as an "
                                                 "env file for compose")
    secrets_cmd.add_argument("--env", default="compose/.env", help="env file to write (kept if it exists); the "
                                                                   "nats-server's users file goes beside it")
    secrets_cmd.add_argument("--replicas", action="append", metavar="SERVICE=N",
                             help="replica users to make for a scalable service (rollout, env-<task>): one per "
                                  "replica `--scale SERVICE=N` runs, plus room for restarts (default: "
                                  "max(8, the compose file's deploy.replicas)); repeatable")
    secrets_cmd.add_argument("--compose", default="", help="the compose file whose scalable services get replica "
                                                           "users (default: docker-compose.yml beside --env)")
    secrets_cmd.add_argument("--prefix", default="jetrl", help="the run's JETRL__NATS__PREFIX: the users' "
                                                               "permissions name it")
    schema = sub.add_parser("schema", help="the message schemas (JSON Schema) and the env protocol's field "
                                           "tables, from shared/messages/; --check: fail if out of date")
    add_schema_arguments(schema)
    add_export_arguments(sub.add_parser("export", help="a run's trajectories as a dataset file (Parquet or JSONL, "
                                                      "the Hugging Face chat format), filtered"))
    add_reverify_arguments(sub.add_parser("reverify", help="replay a run's stored episodes against fresh env "
                                                           "sessions and report where the grade differs"))
    args, rest = parser.parse_known_args(argv)
    setup_logging("cli", level="warning")  # the CLI prints its own lines; services log to their files
    if args.command in MODE_DEFAULTS:
        return launch(args, rest, args.command)
    if args.command == "serve":
        return cmd_serve(args, rest)
    if args.command == "quickstart":
        return cmd_quickstart(args, rest)
    if args.command == "topology":
        return cmd_topology(args, rest)
    if args.command == "env-check":
        return cmd_env_check(args.task, args.config, rest, args.episodes, args.wait)
    if args.command == "export":
        return cmd_export(args, rest)
    if args.command == "reverify":
        return cmd_reverify(args, rest)
    if rest:
        parser.error(f"unrecognised arguments: {rest}")
    if args.command == "secrets":
        return cmd_secrets(args)
    if args.command == "watch":
        return cmd_watch(args)
    if args.command == "status":
        return cmd_status(args)
    if args.command == "creds":
        return cmd_creds(args)
    if args.command == "schema":
        return run_schema(args)
    if args.markdown:
        return run_configref(args)
    print(describe(args.task, load_config(args.config).env))
    return 0


if __name__ == "__main__":
    sys.exit(main())
