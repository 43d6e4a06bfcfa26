"""Deterministic generator of training tasks at three difficulty levels.

Task ``<split>-<i>`` is built from ``random.Random("db:<split>:<i>")`` alone, so ids are stable across
replicas and do not depend on how many tasks a split has. Level = 1 + i % 3:

1. easy: one table, one condition: counting, lookup, aggregation, ranking, INSERT, UPDATE, DELETE by key;
2. medium: one table, two conditions: comparisons, conditional counting/aggregation/ranking, the most
   frequent category, multi-column and conditional UPDATE, conditional DELETE;
3. hard: several tables joined (Chinook, see ``sources.py``): counts, sums, averages and rankings over
   joins, INSERT/UPDATE/DELETE whose rows are found through another table.

Tables for levels 1-2 are AgentBench-like synthetic tables (themes below) or real tables from
``pydataset``. Train and test draw from disjoint table pools (synthetic: disjoint row vocabularies by
seed; pydataset and Chinook: entities split by a hash of their name), so no test question or table
appears in train. Every task is checked on SQLite before it is used: a non-empty, tie-free answer for
SELECT-type tasks, a changed table for modifications; the gold itself is computed per backend.
"""

from __future__ import annotations

import hashlib
import random
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

from services.envs.db.tasks import Table, Task

FIRST = ["Alice", "Bruno", "Chen", "Dara", "Elena", "Farid", "Grace", "Hiro", "Ines", "Jonas", "Kira", "Liam",
         "Maya", "Nikolai", "Olga", "Pedro", "Quinn", "Rosa", "Sami", "Tara", "Umar", "Vera", "Wen", "Yusuf", "Zoe"]
LAST = ["Abbott", "Bauer", "Costa", "Dubois", "Eriksen", "Fischer", "Garcia", "Haddad", "Ivanova", "Jensen",
        "Kowalski", "Lopez", "Moreau", "Nakamura", "Okafor", "Petrov", "Rossi", "Schmidt", "Tanaka", "Usman",
        "Varga", "Weber", "Xu", "Yilmaz", "Zhang"]
ADJ = ["Silver", "Crimson", "Quiet", "Golden", "Northern", "Rapid", "Hidden", "Lucky", "Iron", "Velvet", "Wild",
       "Frozen", "Bright", "Ancient", "Electric", "Lonely", "Royal", "Broken", "Secret", "Blue"]
NOUN = ["River", "Falcon", "Harbor", "Garden", "Engine", "Lantern", "Mountain", "Compass", "Orchard", "Signal",
        "Canyon", "Meadow", "Tower", "Voyage", "Anchor", "Comet", "Forest", "Bridge", "Mirror", "Island"]

# name, key column (kind), categorical columns, numeric columns (lo, hi, decimals)
THEMES: list[dict[str, Any]] = [
    {"table": "Employee Records", "key": ("Name", "person"),
     "cats": {"Department": ["Sales", "Engineering", "Finance", "Support", "Legal", "Marketing"],
              "Office": ["Berlin", "Lagos", "Lima", "Osaka", "Toronto"]},
     "nums": {"Salary": (32000, 150000, 0), "Age": (21, 64, 0), "Years of Service": (0, 35, 0)}},
    {"table": "Product Catalog", "key": ("Product", "thing"),
     "cats": {"Category": ["Audio", "Kitchen", "Garden", "Toys", "Office", "Sports"],
              "Brand": ["Acme", "Borealis", "Cobalt", "Dynamo", "Ember"]},
     "nums": {"Price": (2, 900, 2), "Stock": (0, 500, 0), "Rating": (1, 5, 1)}},
    {"table": "Film Releases", "key": ("Title", "title"),
     "cats": {"Genre": ["Drama", "Comedy", "Horror", "Documentary", "Animation", "Thriller"],
              "Studio": ["Northlight", "Paper Moon", "Redwood", "Skyline"]},
     "nums": {"Year": (1970, 2024, 0), "Runtime": (70, 190, 0), "Gross (millions)": (0, 950, 1)}},
    {"table": "League Standings", "key": ("Club", "club"),
     "cats": {"Division": ["North", "South", "East", "West"], "Country": ["Chile", "Ghana", "Norway", "Vietnam"]},
     "nums": {"Wins": (0, 30, 0), "Losses": (0, 30, 0), "Points": (0, 95, 0), "Goal Difference": (-40, 60, 0)}},
    {"table": "City Statistics", "key": ("City", "city"),
     "cats": {"Region": ["Coastal", "Highland", "Valley", "Plains", "Delta"],
              "Climate": ["Arid", "Temperate", "Tropical", "Polar"]},
     "nums": {"Population": (5000, 2500000, 0), "Area km2": (10, 3000, 1), "Founded": (900, 1990, 0)}},
]


def split_of(key: str, test_share: int = 5) -> str:
    """A stable split for a named thing: about 1 in ``test_share`` goes to test."""
    return "test" if int(hashlib.md5(key.encode()).hexdigest(), 16) % test_share == 0 else "train"


def lit(value: Any) -> str:
    """A SQL literal valid in MySQL and SQLite."""
    if value is None:
        return "NULL"
    if isinstance(value, bool):
        return str(int(value))
    if isinstance(value, (int, float)):
        return repr(value)
    return "'" + str(value).replace("\\", "\\\\").replace("'", "''") + "'"


def q(name: str) -> str:
    return "`" + name.replace("`", "``") + "`"


def say(value: Any) -> str:
    """A value as the question states it."""
    return f"'{value}'" if isinstance(value, str) else str(value)


# ------------------------------------------------------------------------------ synthetic tables
def _key_values(rng: random.Random, kind: str, n: int, split: str) -> list[str]:
    # train and test use disjoint halves of the second word list, so their keys never collide
    half = 0 if split == "train" else 1
    seconds = {"person": LAST, "thing": NOUN, "title": NOUN, "club": NOUN, "city": NOUN}[kind]
    seconds = [w for i, w in enumerate(seconds) if i % 2 == half]
    firsts = {"person": FIRST, "thing": ADJ, "title": ADJ, "club": ADJ, "city": ADJ}[kind]
    pool = [f"{a} {b}" for a in firsts for b in seconds]
    if kind == "club":
        pool = [f"{p} FC" for p in pool]
    if kind == "title":
        pool = [f"The {p}" for p in pool]
    if kind == "city":
        pool = [f"{a}{b.lower()}" for a in firsts for b in seconds]
    return rng.sample(pool, n)


def _num(rng: random.Random, lo: float, hi: float, dec: int) -> int | float:
    return rng.randint(int(lo), int(hi)) if dec == 0 else round(rng.uniform(lo, hi), dec)


def synthetic_table(rng: random.Random, split: str, n_rows: int) -> Table:
    theme = rng.choice(THEMES)
    key, kind = theme["key"]
    cats, nums = list(theme["cats"]), list(theme["nums"])
    columns = [(key, "TEXT")] + [(c, "TEXT") for c in cats] + [
        (c, "INTEGER" if theme["nums"][c][2] == 0 else "REAL") for c in nums]
    rows = []
    for k in _key_values(rng, kind, n_rows, split):
        rows.append([k] + [rng.choice(theme["cats"][c]) for c in cats] + [_num(rng, *theme["nums"][c]) for c in nums])
    return Table(name=theme["table"], columns=columns, rows=rows, key=key, cats=cats, nums=nums)


def new_row(rng: random.Random, table: Table, split: str) -> list[Any]:
    """A plausible row whose key is not in the table (values drawn from the existing columns)."""
    used = {r[table.column_names.index(table.key)] for r in table.rows} if table.key else set()
    row = [rng.choice(table.rows)[i] for i in range(len(table.columns))]
    if table.key:
        idx = table.column_names.index(table.key)
        candidates = [f"{a} {b}" for a in ADJ for b in NOUN if f"{a} {b}" not in used]
        row[idx] = rng.choice(candidates)
    for i, (c, ty) in enumerate(table.columns):
        if c in table.nums:
            vals = [r[i] for r in table.rows if isinstance(r[i], (int, float))]
            lo, hi = min(vals), max(vals)
            row[i] = rng.randint(int(lo), int(hi)) if ty == "INTEGER" else round(rng.uniform(lo, hi), 2)
    return row


# ------------------------------------------------------------------------ single-table questions
def _col(table: Table, name: str) -> list[Any]:
    i = table.column_names.index(name)
    return [r[i] for r in table.rows]


def _threshold(rng: random.Random, values: list[Any]) -> Any:
    vals = sorted(v for v in values if isinstance(v, (int, float)))
    return vals[rng.randint(len(vals) // 4, (3 * len(vals)) // 4)]


AGG = {"SUM": "total", "AVG": "average", "MAX": "highest", "MIN": "lowest"}


def single_table_question(rng: random.Random, t: Table, level: int, split: str) -> tuple[str, str, str]:
    """(type, description, reference SQL) for one table with key/categorical/numeric roles."""
    T, name = q(t.name), t.name
    cat = rng.choice(t.cats)
    cv = rng.choice(sorted(set(_col(t, cat)), key=str))
    num = rng.choice(t.nums)
    key = t.key
    op, op_word = rng.choice([(">", "greater than"), ("<", "less than")])
    x = _threshold(rng, _col(t, num))
    if not key:  # tables without a unique name column get the questions that need none
        return _keyless_question(rng, t, level, cat, cv, num, op, op_word, x)
    if level == 1:
        kind = rng.choice(["counting", "other", "aggregation", "ranking", "INSERT", "UPDATE", "DELETE"])
        if kind == "counting":
            return kind, f"How many entries in the {name} table have {cat} equal to {say(cv)}?", \
                f"SELECT COUNT(*) FROM {T} WHERE {q(cat)} = {lit(cv)}"
        if kind == "other":
            k = rng.choice(_col(t, key))
            col = rng.choice([c for c in t.column_names if c != key])
            return kind, f"What is the {col} of the entry whose {key} is {say(k)}?", \
                f"SELECT {q(col)} FROM {T} WHERE {q(key)} = {lit(k)}"
        if kind == "aggregation":
            fn = rng.choice(list(AGG))
            return f"aggregation-{fn}", f"What is the {AGG[fn]} {num} over all entries of the {name} table?", \
                f"SELECT {fn}({q(num)}) FROM {T}"
        if kind == "ranking":
            desc = rng.random() < 0.5
            return kind, f"Which {key} has the {'highest' if desc else 'lowest'} {num}?", \
                f"SELECT {q(key)} FROM {T} ORDER BY {q(num)} {'DESC' if desc else 'ASC'} LIMIT 1"
        if kind == "INSERT":
            row = new_row(rng, t, split)
            pairs = ", ".join(f"{c} {say(v)}" for c, v in zip(t.column_names, row, strict=True))
            return kind, f"Insert a new entry into the {name} table with {pairs}.", \
                f"INSERT INTO {T} ({', '.join(q(c) for c in t.column_names)}) VALUES ({', '.join(lit(v) for v in row)})"
        if kind == "UPDATE":
            k = rng.choice(_col(t, key))
            col = rng.choice(t.nums + t.cats)
            v = new_row(rng, t, split)[t.column_names.index(col)]
            return kind, f"Change the {col} of the entry whose {key} is {say(k)} to {say(v)}.", \
                f"UPDATE {T} SET {q(col)} = {lit(v)} WHERE {q(key)} = {lit(k)}"
        k = rng.choice(_col(t, key))
        return "DELETE", f"Delete the entry whose {key} is {say(k)} from the {name} table.", \
            f"DELETE FROM {T} WHERE {q(key)} = {lit(k)}"
    kind = rng.choice(["counting", "comparison", "aggregation", "ranking", "ranking-group", "INSERT", "UPDATE",
                       "DELETE"])
    cond_sql = f"{q(cat)} = {lit(cv)} AND {q(num)} {op} {lit(x)}"
    cond_say = f"{cat} equal to {say(cv)} and {num} {op_word} {x}"
    if kind == "counting":
        return kind, f"How many entries have {cond_say}?", f"SELECT COUNT(*) FROM {T} WHERE {cond_sql}"
    if kind == "comparison":
        return kind, f"Which {key} values belong to entries with {cond_say}?", \
            f"SELECT {q(key)} FROM {T} WHERE {cond_sql}"
    if kind == "aggregation":
        fn = rng.choice(list(AGG))
        num2 = rng.choice([n for n in t.nums if n != num] or [num])
        return f"aggregation-{fn}", f"What is the {AGG[fn]} {num2} among entries with {cat} equal to {say(cv)}?", \
            f"SELECT {fn}({q(num2)}) FROM {T} WHERE {q(cat)} = {lit(cv)}"
    if kind == "ranking":
        desc = rng.random() < 0.5
        return kind, f"Among entries with {cat} equal to {say(cv)}, which {key} has the " \
                     f"{'highest' if desc else 'lowest'} {num}?", \
            f"SELECT {q(key)} FROM {T} WHERE {q(cat)} = {lit(cv)} ORDER BY {q(num)} {'DESC' if desc else 'ASC'} LIMIT 1"
    if kind == "ranking-group":
        return "ranking", f"Which {cat} occurs in the most entries of the {name} table?", \
            f"SELECT {q(cat)} FROM {T} GROUP BY {q(cat)} ORDER BY COUNT(*) DESC LIMIT 1"
    if kind == "INSERT":
        rows = [new_row(rng, t, split) for _ in range(2)]
        said = "; ".join(", ".join(f"{c} {say(v)}" for c, v in zip(t.column_names, r, strict=True)) for r in rows)
        vals = ", ".join("(" + ", ".join(lit(v) for v in r) + ")" for r in rows)
        return kind, f"Add two entries to the {name} table: {said}.", \
            f"INSERT INTO {T} ({', '.join(q(c) for c in t.column_names)}) VALUES {vals}"
    if kind == "UPDATE":
        d = rng.randint(1, 9)
        return kind, f"Increase the {num} of every entry with {cat} equal to {say(cv)} by {d}.", \
            f"UPDATE {T} SET {q(num)} = {q(num)} + {d} WHERE {q(cat)} = {lit(cv)}"
    return "DELETE", f"Delete every entry with {cond_say} from the {name} table.", \
        f"DELETE FROM {T} WHERE {cond_sql}"


def _keyless_question(rng: random.Random, t: Table, level: int, cat: str, cv: Any, num: str, op: str, op_word: str,
                      x: Any) -> tuple[str, str, str]:
    T, name = q(t.name), t.name
    kind = rng.choice(["counting", "aggregation", "comparison" if level == 2 else "aggregation", "ranking-group",
                       "INSERT", "UPDATE", "DELETE"])
    cond_sql, cond_say = f"{q(cat)} = {lit(cv)}", f"{cat} equal to {say(cv)}"
    if level == 2:
        cond_sql += f" AND {q(num)} {op} {lit(x)}"
        cond_say += f" and {num} {op_word} {x}"
    if kind == "counting":
        return kind, f"How many entries of the {name} table have {cond_say}?", \
            f"SELECT COUNT(*) FROM {T} WHERE {cond_sql}"
    if kind == "aggregation":
        fn = rng.choice(list(AGG))
        num2 = rng.choice(t.nums)
        return f"aggregation-{fn}", f"What is the {AGG[fn]} {num2} among entries of the {name} table with " \
                                    f"{cat} equal to {say(cv)}?", \
            f"SELECT {fn}({q(num2)}) FROM {T} WHERE {q(cat)} = {lit(cv)}"
    if kind == "comparison":
        return kind, f"Which values of {cat} occur in entries of the {name} table with {num} {op_word} {x}?", \
            f"SELECT DISTINCT {q(cat)} FROM {T} WHERE {q(num)} {op} {lit(x)}"
    if kind == "ranking-group":
        return "ranking", f"Which {cat} occurs in the most entries of the {name} table?", \
            f"SELECT {q(cat)} FROM {T} GROUP BY {q(cat)} ORDER BY COUNT(*) DESC LIMIT 1"
    if kind == "INSERT":
        row = new_row(rng, t, "")
        pairs = ", ".join(f"{c} {say(v)}" for c, v in zip(t.column_names, row, strict=True))
        return kind, f"Insert a new entry into the {name} table with {pairs}.", \
            f"INSERT INTO {T} ({', '.join(q(c) for c in t.column_names)}) VALUES ({', '.join(lit(v) for v in row)})"
    if kind == "UPDATE":
        v = new_row(rng, t, "")[t.column_names.index(num)]
        return kind, f"Set {num} to {v} for every entry of the {name} table with {cond_say}.", \
            f"UPDATE {T} SET {q(num)} = {lit(v)} WHERE {cond_sql}"
    return "DELETE", f"Delete every entry with {cond_say} from the {name} table.", f"DELETE FROM {T} WHERE {cond_sql}"


# -------------------------------------------------------------------------------------- checking
def check(task: Task) -> bool:
    """A task is usable when its reference SQL runs on SQLite and has a clear, non-trivial answer."""
    from services.envs.db.backends import Limits
    from services.envs.db.sqlite_db import SQLiteDB

    db = SQLiteDB(task.tables, Limits(timeout_s=5.0, max_rows=100_000, max_chars=10**9))
    try:
        before = db.table_hash(None)
        rows, after = db.gold(task.ref_sql, task.modifies, None)
        if task.modifies:
            return after != before and all(len(t.rows) for t in task.tables)
        if not rows or any(v is None for r in rows for v in r) or len(rows) > 12:
            return False
        tie_sql = task.meta.get("tie_sql")
        if tie_sql:  # a ranking's top value must be unique
            top = db.conn.execute(tie_sql).fetchall()
            if len(top) == 2 and top[0] == top[1]:
                return False
        return True
    except Exception:
        return False
    finally:
        db.close()


def tie_check(sql: str) -> str:
    """For ``SELECT x FROM ... ORDER BY e [DIR] LIMIT 1``: the query of the top two ``e`` values."""
    if "ORDER BY" not in sql or not sql.endswith("LIMIT 1"):
        return ""
    head, order = sql.rsplit("ORDER BY", 1)
    expr = order.rsplit("LIMIT", 1)[0].strip()
    expr = expr.rsplit(" ", 1)[0] if expr.endswith((" ASC", " DESC")) else expr
    body = head.split(" FROM ", 1)[1]
    return f"SELECT {expr} FROM {body}ORDER BY {order.rsplit('LIMIT', 1)[0].strip()} LIMIT 2"


# -------------------------------------------------------------------------------------- catalogue
def level_of(index: int) -> int:
    """The difficulty level of generated task ``index``: the levels take turns, so any prefix is balanced."""
    return 1 + index % 3


def generate(split: str, index: int, pydataset_tables: dict[str, Sequence[Table]] | None = None,
             multi: Callable[[random.Random, str], tuple[str, str, str, list[Table]]] | None = None) -> Task:
    """Task ``<split>-<index>``: deterministic in (split, index) and the given sources."""
    level = level_of(index)
    real = (pydataset_tables or {}).get(split, [])
    for attempt in range(50):
        rng = random.Random(f"db:{split}:{index}:{attempt}")
        if level == 3 and multi is not None:
            kind, description, sql, tables = multi(rng, split)
            source = "chinook"
        else:
            if real and rng.random() < 0.4:
                base = rng.choice(real)
                table = Table(name=base.name, columns=base.columns, rows=[list(r) for r in base.rows], key=base.key,
                              cats=base.cats, nums=base.nums)
                source = "pydataset"
            else:
                table = synthetic_table(rng, split, rng.randint(8, 24) if level == 1 else rng.randint(15, 40))
                source = "synthetic"
            kind, description, sql = single_table_question(rng, table, min(level, 2), split)
            tables = [table]
        task = Task(task_id=f"{split}-{index:05d}", type=kind, description=description, tables=tables, ref_sql=sql,
                    level=level, source=source, meta={"tie_sql": tie_check(sql)})
        if check(task):
            return task
    raise RuntimeError(f"could not generate a usable db task {split}-{index}")


def answer_counts(tasks: Sequence[Task]) -> Counter[str]:
    return Counter(t.type for t in tasks)
