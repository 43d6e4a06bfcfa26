"""The learning benchmark's report (bench/learning_report.py) on hand-made probe reports: run names per seed,
pass@k per task from the sampled pass, the seeds' spread, steps until a gain, the sampler table, and a record of
several sittings (each with its own warm start) that the benchmark resumes from."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from bench.learning import Bench, finished_types, merge_probes, model_digest, run_name, whole
from bench.learning_report import (
    flatten,
    pass_at_k_table,
    pass_at_per_task,
    sampler_table,
    seeds_table,
    steps_to_gain,
    table,
    variant_of,
)


def probe(rates: dict[str, dict[str, float]], samples: int = 4) -> dict:
    """A probe report as `jetrl probe` writes it, for the fields the benchmark reads: per task type, the
    success of each task id in the greedy and the sampled pass."""
    def one(per_id: dict[str, float], n: int) -> dict:
        return {"tasks": len(per_id), "episodes": n * len(per_id), "per_task_success": per_id,
                "success": sum(per_id.values()) / len(per_id), "success_ci95": [0.0, 1.0]}
    return {"greedy": {t: one({k: float(v >= 0.5) for k, v in ids.items()}, 1) for t, ids in rates.items()},
            "sampled": {t: one(ids, samples) for t, ids in rates.items()}}


def test_run_names_carry_the_seed() -> None:
    assert run_name("full", 0) == "full"
    assert run_name("full", 1) == "full-s1"
    assert [variant_of(n) for n in ("full-s1", "no_task_norm-s12", "expert-db", "expert-sql", "sampler")] == \
        ["full", "no_task_norm", "expert-db", "expert-sql", "sampler"]


def test_pass_at_k_per_task_from_the_sampled_success() -> None:
    report = probe({"db": {"a": 0.0, "b": 0.25, "c": 1.0}}, samples=4)
    # b: 1 of 4 right; pass@2 = 1 - C(3,2)/C(4,2) = 1 - 3/6
    assert pass_at_per_task(report, "db", 2) == {"a": 0.0, "b": 0.5, "c": 1.0}
    assert pass_at_per_task(report, "db", 4) == {"a": 0.0, "b": 1.0, "c": 1.0}
    assert pass_at_per_task(report, "db", 8) == {}  # 4 attempts cannot give pass@8
    assert pass_at_per_task(report, "os", 2) == {}


def test_pass_at_k_table_before_and_after() -> None:
    before = probe({"db": {"a": 0.0, "b": 0.25}}, samples=4)
    after = probe({"db": {"a": 0.0, "b": 0.75}}, samples=4)
    results = {"runs": {}, "evals": {"warm_start@test": {"report": before}, "full@test": {"report": after}}}
    text = "\n".join(pass_at_k_table(results, ["db"], "test"))
    # pass@1: (0 + 0.25) / 2 -> (0 + 0.75) / 2; pass@4: b solved at least once in both -> 0.5 and 0.5
    assert "| warm_start | 0.125 [" in text and "| full | 0.375 [" in text
    change = next(line for line in text.splitlines() if line.startswith("| full | +"))
    cells = [c.strip() for c in change.strip("|").split("|")]
    assert cells[1].startswith("+25.0") and cells[3].startswith("+0.0")  # pass@1 rose; pass@4 did not
    assert "pass@8" not in text


def test_a_warm_start_alone_gets_its_tables_without_empty_change_tables() -> None:
    """Before any run is probed (the first sitting of a long benchmark): the warm start's success and pass@k,
    and no change table of header lines only."""
    results = {"runs": {}, "metrics": {}, "base": {},
               "evals": {"warm_start@test": {"report": probe({"db": {"a": 0.0, "b": 0.25}}, samples=4)}}}
    text = table(results, ["db"], ["test"])
    assert "| warm_start | 0.12 [" in text and "| warm_start | 0.125 [" in text  # sampled success, pass@1
    assert "Change" not in text


def test_seeds_table_gives_the_mean_and_the_spread() -> None:
    base = probe({"db": {"a": 0.0, "b": 0.0}})
    evals = {"warm_start@test": {"report": base},
             "full@test": {"report": probe({"db": {"a": 0.25, "b": 0.0}})},     # +12.5
             "full-s1@test": {"report": probe({"db": {"a": 0.5, "b": 0.25}})},  # +37.5
             "no_cross_policy@test": {"report": probe({"db": {"a": 0.0, "b": 0.5}})}}
    text = "\n".join(seeds_table({"runs": {}, "evals": evals}, ["db"], "test"))
    assert "| full | 2 | +25.0 (+12.5, +37.5) | +25.0 (+12.5, +37.5) |" in text
    assert "| no_cross_policy | 1 | +25.0 (+25.0, +25.0) |" in text
    assert seeds_table({"runs": {}, "evals": {"warm_start@test": {"report": base},
                                              "full@test": evals["full@test"]}}, ["db"], "test") == []


def test_steps_to_gain() -> None:
    rows = [{"step": i + 1, "task/db/success": v, "task/os/success": v}
            for i, v in enumerate([0.1, 0.1, 0.1, 0.15, 0.2, 0.3, 0.4])]
    # start 0.1; moving means of 3 from step 3: 0.1, .117, .15, .217 (step 6) >= 0.2
    assert steps_to_gain(rows, ["db", "os"]) == 6
    assert steps_to_gain(rows, ["db"], gain=0.5) is None
    assert steps_to_gain(rows[:4], ["db"]) is None


def test_sampler_table_counts_flat_groups(tmp_path: Path) -> None:
    for name, flat in (("full", 6), ("sampler", 2)):
        (tmp_path / name).mkdir()
        rows = [{"step": s, "ts": float(s), "train/groups": 2.0, "train/flat_groups": float(min(s, flat)),
                 "task/db/success": 0.2} for s in range(1, 11)]
        (tmp_path / name / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    base = probe({"db": {"a": 0.0}})
    results = {"out": str(tmp_path), "runs": {"full": {"tasks": ["db"]}, "sampler": {"tasks": ["db"]}},
               "evals": {"warm_start@test": {"report": base}, "full@test": {"report": base},
                         "sampler@test": {"report": probe({"db": {"a": 0.5}})}}}
    text = "\n".join(sampler_table(flatten({"current": results}), ["db"], "test"))
    assert "| full | 10 | 6/26 (23%) | not reached | +0.0" in text
    assert "| sampler | 10 | 2/22 (9%) | not reached | +50.0" in text
    # training runs alone (no probe): no probe column of dashes
    unprobed = flatten({"current": {**results, "evals": {}}})
    text = "\n".join(sampler_table(unprobed, ["db"], "test"))
    assert "| sampler | 10 | 2/22 (9%) | not reached |" in text and "sampled change" not in text and "–" not in text


@pytest.mark.parametrize("names", [["full"], ["full", "no_cross_policy"]])
def test_no_sampler_table_without_a_sampler_run(names: list[str]) -> None:
    assert sampler_table({"runs": {n: {} for n in names}, "evals": {}}, ["db"], "test") == []


def two_sittings() -> dict[str, dict]:
    """Sitting A: warm start 0.0 on both ids, `full` +50 on one id. Sitting B: another warm start, already
    at 0.5; `full-s1` from it reaches 1.0 on both ids (+50 against B, not +100 against A)."""
    a = {"tasks": ["db"], "runs": {"sft": {"wall_s": 60.0}, "full": {"tasks": ["db"], "rc": 0}},
         "evals": {"warm_start@test": {"report": probe({"db": {"x": 0.0, "y": 0.0}})},
                   "full@test": {"report": probe({"db": {"x": 1.0, "y": 0.0}})}},
         "metrics": {"sft": [{"step": 1, "ts": 0.0, "train/loss": 1.0}]}}
    b = {"tasks": ["db"], "runs": {"sft": {"wall_s": 90.0}, "full-s1": {"tasks": ["db"], "rc": 0}},
         "evals": {"warm_start@test": {"report": probe({"db": {"x": 0.5, "y": 0.5}})},
                   "full-s1@test": {"report": probe({"db": {"x": 1.0, "y": 1.0}})}}}
    return {"aaaa": a, "bbbb": b}


def test_a_record_pairs_every_run_with_its_own_warm_start() -> None:
    flat = flatten(two_sittings())
    assert flat["base"] == {"full": "warm_start-aaaa", "full-s1": "warm_start-bbbb"}
    assert set(flat["runs"]) == {"sft-aaaa", "full", "sft-bbbb", "full-s1"}
    assert flat["metrics"]["sft-aaaa"][0]["train/loss"] == 1.0
    text = table(flat, ["db"], ["test"])
    assert "| warm_start-aaaa | 0.00 [" in text and "| warm_start-bbbb | 0.50 [" in text
    assert "1.0 min" in text and "1.5 min" in text  # each warm start's own SFT wall time
    sampled = text[text.index("Change against its warm start (test, sampled)"):]
    assert "| full | +50.0" in sampled and "| full-s1 | +50.0" in sampled
    # the seeds of `full` come from two sittings: +50 each
    assert "| full | 2 | +50.0 (+50.0, +50.0) |" in "\n".join(seeds_table(flat, ["db"], "test"))
    # one sitting alone keeps the plain names
    one = flatten({"aaaa": two_sittings()["aaaa"]})
    assert "warm_start@test" in one["evals"] and "sft" in one["runs"] and one["base"] == {"full": "warm_start"}


def bench_args(tmp_path: Path, record: Path) -> argparse.Namespace:
    return argparse.Namespace(out=str(tmp_path / "out"), time_limit_min=1.0, config="configs/smollm2.toml",
                              skip_done=True, record=str(record), eval_splits=["test"])


def test_the_record_carries_runs_across_sittings(tmp_path: Path) -> None:
    record = tmp_path / "record.json"
    record.write_text(json.dumps({"sittings": two_sittings()}))
    model = tmp_path / "model"
    model.mkdir()
    (model / "model.safetensors").write_bytes(b"new warm start")
    bench = Bench(bench_args(tmp_path, record), [])
    bench.adopt_warm_start(model)
    digest = model_digest(model)
    assert bench.digest == digest and len(digest) == 10
    # runs another sitting ran and probed are not run again; the rest are
    assert bench.recorded_elsewhere("full") == "aaaa" and bench.recorded_elsewhere("full-s1") == "bbbb"
    assert bench.recorded_elsewhere("no_cross_policy") == ""
    # this sitting went into the record under its digest, beside the two it found
    saved = json.loads(record.read_text())["sittings"]
    assert set(saved) == {"aaaa", "bbbb", digest}
    assert saved[digest]["warm_start"]["digest"] == digest and saved[digest]["machine"]


def test_the_same_warm_start_made_again_resumes_its_sitting(tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "model.safetensors").write_bytes(b"warm start")
    digest = model_digest(model)
    sittings = two_sittings()
    record = tmp_path / "record.json"
    record.write_text(json.dumps({"sittings": {digest: sittings["aaaa"]}}))
    bench = Bench(bench_args(tmp_path, record), [])
    bench.adopt_warm_start(model)
    # its probe and its run are this sitting's own: reused, not recorded "elsewhere"
    assert "warm_start@test" in bench.results["evals"] and "full" in bench.results["runs"]
    assert bench.recorded_elsewhere("full") == "" and bench.probed("full") and not bench.probed("no_task_norm")
    (model / "model.safetensors").write_bytes(b"another warm start")
    assert model_digest(model) != digest


def test_with_no_split_to_probe_a_run_is_done_when_it_ran(tmp_path: Path) -> None:
    """A benchmark of training runs alone (``--eval-splits ''``, the sampler comparison): a run not made yet
    is not skipped as "probed on every one of no splits"; a finished one, here or in another sitting, is."""
    sittings = two_sittings()
    record = tmp_path / "record.json"
    record.write_text(json.dumps({"sittings": sittings}))
    model = tmp_path / "model"
    model.mkdir()
    (model / "model.safetensors").write_bytes(b"warm start")
    bench = Bench(argparse.Namespace(**{**vars(bench_args(tmp_path, record)), "eval_splits": []}), [])
    bench.adopt_warm_start(model)
    assert not bench.probed("sampler") and bench.recorded_elsewhere("sampler") == ""
    bench.results["runs"]["sampler"] = {"rc": 130, "timeout": True, "wall_s": 60.0}
    assert bench.probed("sampler")
    bench.results["runs"]["sampler-s1"] = {"rc": 1, "timeout": False, "wall_s": 5.0}  # failed: run it again
    assert not bench.probed("sampler-s1")
    assert bench.recorded_elsewhere("full") == "aaaa"


def test_a_stopped_probe_keeps_its_whole_task_types_and_a_resumed_one_plays_the_rest() -> None:
    stopped = probe({"db": {"a": 1.0, "b": 0.0}, "alfworld": {"a": 0.0}}, samples=4)
    for name, by_task in stopped.items():  # as the controller writes eval.partial.json on its way out
        for task, r in by_task.items():
            r["planned"] = 2 * (1 if name == "greedy" else 4)
            r["complete"] = task == "db" or name == "greedy"
    kept, missing = merge_probes({}, finished_types(stopped), ["db", "alfworld"])
    assert sorted(kept["greedy"]) == ["alfworld", "db"] and sorted(kept["sampled"]) == ["db"]
    assert missing == ["alfworld"]  # its sampled pass did not finish: the resumed probe plays alfworld again
    assert not whole({"report": kept, "missing": missing})
    resumed = probe({"alfworld": {"a": 0.25, "b": 0.0}}, samples=4)
    merged, missing = merge_probes(kept, resumed, ["db", "alfworld"])
    assert missing == [] and whole({"report": merged, "missing": missing})
    assert merged["greedy"]["db"] is kept["greedy"]["db"]
    assert merged["sampled"]["alfworld"]["per_task_success"] == {"a": 0.25, "b": 0.0}  # the resumed probe's
    assert merge_probes({}, {}, ["db"]) == ({}, ["db"])
