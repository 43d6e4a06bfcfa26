"""``jetrl schema``: every message of ``shared/messages/`` as JSON Schema, and the env messages' field tables
of docs/env-protocol.md, generated from the code so the spec cannot drift from it.

``jetrl schema`` writes ``docs/schemas/<kind>.json`` (one self-contained schema per message) and the part of
docs/env-protocol.md between the ``<!-- fields:begin -->`` and ``<!-- fields:end -->`` markers;
``jetrl schema --check`` writes nothing and fails, naming the files, when either differs from what the code
makes (tests/shared/test_env_protocol.py runs that check in ``make test``).

The schemas describe the msgpack maps on the wire: a ``bytes`` field is msgpack ``bin`` (JSON Schema has no
such type, so it reads as a base64 string, as msgspec writes it). Field descriptions are the attribute
docstrings of the message classes.
"""

from __future__ import annotations

import argparse
import ast
import inspect
import json
from pathlib import Path
from typing import Any

import msgspec

from shared import messages
from shared.messages import MESSAGES, Message, base, control, env, episodes

REPO = Path(__file__).resolve().parent.parent
SCHEMA_DIR = REPO / "docs" / "schemas"
SPEC = REPO / "docs" / "env-protocol.md"
BEGIN, END = "<!-- fields:begin -->", "<!-- fields:end -->"

ENV_MESSAGES: tuple[type[Message], ...] = (
    messages.EnvStart, messages.EnvStarted, messages.EnvInteract, messages.EnvOracle, messages.EnvCancel,
    messages.EnvStep, messages.EnvTaskList, messages.EnvHealth, messages.Heartbeat, messages.DeadLetter,
)
"""What an env receives, answers and publishes: the messages the spec tables field by field."""


def field_docs() -> dict[str, dict[str, str]]:
    """Class name -> field -> the docstring under the field's annotation in shared/messages/."""
    out: dict[str, dict[str, str]] = {}
    for module in (base, episodes, env, control):  # every module that defines a message or a part of one
        for node in ast.parse(inspect.getsource(module)).body:
            if not isinstance(node, ast.ClassDef):
                continue
            docs = out.setdefault(node.name, {})
            for stmt, after in zip(node.body, node.body[1:], strict=False):
                target = stmt.target if isinstance(stmt, ast.AnnAssign) else (
                    stmt.targets[0] if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 else None)
                if (isinstance(target, ast.Name) and isinstance(after, ast.Expr)
                        and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str)):
                    docs[target.id] = _markdown(after.value.value)
    return out


def _markdown(doc: str) -> str:
    """A docstring as one line of markdown (reST's ``code`` becomes `code`)."""
    return " ".join(doc.split()).replace("``", "`")


def message_schemas() -> dict[str, dict[str, Any]]:
    """Kind -> a self-contained JSON Schema (draft 2020-12) of that message's msgpack map."""
    _, components = msgspec.json.schema_components(MESSAGES, ref_template="#/$defs/{name}")
    docs = field_docs()
    out: dict[str, dict[str, Any]] = {}
    for cls in MESSAGES:
        body = json.loads(json.dumps(components[cls.__name__]))  # a copy we may annotate
        for klass in reversed(cls.__mro__):  # a subclass's docstring of a field wins over its base's
            for name, text in docs.get(klass.__name__, {}).items():
                if name in body["properties"]:
                    body["properties"][name]["description"] = text
        body["properties"]["v"].update(minimum=1, maximum=cls.VERSION)  # readers refuse a newer version
        refs = _refs(body)
        schema: dict[str, Any] = {"$schema": "https://json-schema.org/draft/2020-12/schema",
                                  "$id": f"{cls.KIND}.json", **body}
        if refs:
            schema["$defs"] = {name: components[name] for name in sorted(refs)}
        out[cls.KIND] = schema
    return out


def _refs(node: Any) -> set[str]:
    if isinstance(node, dict):
        found = {node["$ref"].rsplit("/", 1)[-1]} if "$ref" in node else set()
        return found.union(*(_refs(v) for v in node.values()))
    if isinstance(node, list):
        return set().union(*(_refs(v) for v in node))
    return set()


def _type(prop: dict[str, Any]) -> str:
    """A property's type as the tables write it: ``list[map]``, ``string, ^[A-Za-z0-9_-]+$, <= 128``."""
    if "$ref" in prop:
        return prop["$ref"].rsplit("/", 1)[-1]
    if "enum" in prop:
        return " | ".join(json.dumps(v) for v in prop["enum"])
    kind = prop.get("type", "any")
    names = {"object": "map", "array": "list", "number": "float", "integer": "int", "boolean": "bool"}
    if kind == "array":
        text = f"list[{_type(prop.get('items', {}))}]"
    elif kind == "object":
        extra = prop.get("additionalProperties")
        text = f"map[string, {_type(extra)}]" if isinstance(extra, dict) and extra else "map"
    elif kind == "string" and prop.get("contentEncoding") == "base64":
        text = "bytes (msgpack bin)"
    else:
        text = names.get(kind, kind)
    bounds = [f"pattern `{prop['pattern']}`"] if "pattern" in prop else []
    for key, sign in (("minimum", ">="), ("maximum", "<="), ("maxLength", "length <=")):
        if key in prop:
            bounds.append(f"{sign} {prop[key]}")
    return ", ".join([text, *bounds])


def field_tables() -> str:
    """The spec's generated section: one table per env message (field, type, default, meaning)."""
    schemas = message_schemas()
    parts = [BEGIN, "<!-- generated by `jetrl schema` from shared/messages/: do not edit by hand -->", ""]
    for cls in ENV_MESSAGES:
        schema = schemas[cls.KIND]
        parts += [f"### `{cls.KIND}` ({cls.__name__}, version {cls.VERSION})", ""]
        if schema.get("description"):
            parts += [_markdown(schema["description"]), ""]
        parts += ["| field | type | default | meaning |", "|---|---|---|---|"]
        required = set(schema.get("required", []))
        for name, prop in schema["properties"].items():
            default = "required" if name in required else json.dumps(prop.get("default", "(computed)"))
            if name == "kind":
                meaning = "the message's tag"
            elif "default" not in prop and name not in required:
                default = "writer's clock" if name == "ts" else "set by the writer"
                meaning = prop.get("description", "")
            else:
                meaning = prop.get("description", "")
            parts.append(f"| `{name}` | {_type(prop)} | {default} | {meaning.replace('|', '/')} |")
        parts.append("")
    status_docs = field_docs().get("EpisodeStatus", {})
    parts += ["### Episode statuses (EpisodeStatus)", "", "| status | meaning |", "|---|---|"]
    for name, value in vars(messages.EpisodeStatus).items():
        if name.isupper():
            parts.append(f"| `{value}` | {status_docs.get(name, '')} |")
    parts += ["", END]
    return "\n".join(parts)


def render_spec(text: str) -> str:
    """``text`` (docs/env-protocol.md) with its generated section replaced by the code's."""
    head, begin, rest = text.partition(BEGIN)
    _, end, tail = rest.partition(END)
    if not begin or not end:
        raise ValueError(f"{SPEC.name} lacks the markers {BEGIN} ... {END} around its generated section")
    return head + field_tables() + tail


def expected_files(schema_dir: Path, spec: Path) -> dict[Path, str]:
    """Every generated file with the text the code makes for it."""
    files = {schema_dir / f"{kind}.json": json.dumps(schema, indent=2, ensure_ascii=False) + "\n"
             for kind, schema in message_schemas().items()}
    files[spec] = render_spec(spec.read_text())
    return files


def stale_files(schema_dir: Path = SCHEMA_DIR, spec: Path = SPEC) -> list[str]:
    """What ``--check`` reports: generated files that differ from the code, and schema files of no message."""
    expected = expected_files(schema_dir, spec)
    stale = [str(p) for p, text in expected.items() if not p.is_file() or p.read_text() != text]
    stale += [f"{p} (no message of that kind)" for p in sorted(schema_dir.glob("*.json")) if p not in expected]
    return stale


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="jetrl schema", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", default=str(SCHEMA_DIR), help="directory of the JSON Schema files")
    parser.add_argument("--spec", default=str(SPEC), help="the spec whose field tables are regenerated")
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if anything is out of date")


def run(args: argparse.Namespace) -> int:
    schema_dir, spec = Path(args.out), Path(args.spec)
    if args.check:
        stale = stale_files(schema_dir, spec)
        for name in stale:
            print(f"jetrl schema: out of date: {name}")
        if stale:
            print("jetrl schema: run `jetrl schema` and commit the result")
            return 1
        print(f"jetrl schema: {len(MESSAGES)} message schemas and the field tables of {spec.name} are up to date")
        return 0
    schema_dir.mkdir(parents=True, exist_ok=True)
    for path, text in expected_files(schema_dir, spec).items():
        path.write_text(text)
    kinds = {cls.KIND for cls in MESSAGES}
    for path in sorted(schema_dir.glob("*.json")):  # a message renamed or gone: its old schema goes too
        if path.stem not in kinds and f'"$id": "{path.name}"' in path.read_text():
            path.unlink()
    print(f"jetrl schema: {len(MESSAGES)} message schemas in {schema_dir}, field tables in {spec}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
