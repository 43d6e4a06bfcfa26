"""A user-supplied Freebase graph: N-Triples in Freebase's namespace, served with the same seven tools.

AgentBench's questions name Freebase entities (``m.09rl290``) and relations (``media_common.quotation.author``)
and are answered on a Virtuoso copy of Freebase. A user who has such a graph (all of it, or the slice the
questions need) as N-Triples points ``env.kg.ntriples`` at the file; it is bulk-loaded once into a
pyoxigraph store under the data dir (keyed by the file's content, so a changed file is loaded again), and
the tools' vocabulary is read off the data:

* relations: predicates in the namespace whose objects are IRIs, except the schema's own ``type.*``;
  a relation's range is its ``type.property.expected_type`` or ``rdfs:range`` where the graph states it,
  else the commonest ``type.object.type`` of its objects (the type ``get_neighbors`` reports);
* attributes: predicates whose objects are typed literals that are not strings (numbers, dates), the
  ones ``get_attributes``, ``argmax`` and ``argmin`` work on.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import pyoxigraph as ox
import structlog

from services.envs.kg.graph import NS, RDFS, TYPE, XSD, Graph, default_data_dir

log = structlog.get_logger()

LOADER_VERSION = 1
EXPECTED_TYPE = "type.property.expected_type"
FALLBACK_TYPE = "common.topic"  # Freebase's type of every topic
TEXT_TYPES = {f"{XSD}string", "http://www.w3.org/1999/02/22-rdf-syntax-ns#langString"}


def _digest(path: Path) -> str:
    h = hashlib.sha256(f"v{LOADER_VERSION}".encode())
    with path.open("rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()[:12]


def _short(value: str) -> str:
    return value[len(NS):] if value.startswith(NS) else value


def derive_ontology(store: ox.Store) -> dict[str, Any]:
    """Relations (with domain and range) and attributes, read off the triples."""
    relations: dict[str, dict[str, str]] = {}
    rows = store.query(f"SELECT DISTINCT ?p WHERE {{ ?s ?p ?o . FILTER(isIRI(?o) && STRSTARTS(STR(?p), \"{NS}\")) }}")
    for (p,) in rows:
        name = _short(p.value)
        if name.startswith("type."):
            continue
        stated = list(store.query(f"SELECT ?t WHERE {{ {{ <{p.value}> <{NS}{EXPECTED_TYPE}> ?t }} UNION "
                                  f"{{ <{p.value}> <{RDFS}range> ?t }} }} LIMIT 1"))
        if stated:
            range_ = _short(stated[0][0].value)
        else:
            common = list(store.query(f"SELECT ?t (COUNT(*) AS ?n) WHERE {{ ?s <{p.value}> ?o . ?o <{NS}{TYPE}> ?t }} "
                                      "GROUP BY ?t ORDER BY DESC(?n) ?t LIMIT 1"))
            range_ = _short(common[0][0].value) if common else FALLBACK_TYPE
        domain = list(store.query(f"SELECT ?t (COUNT(*) AS ?n) WHERE {{ ?s <{p.value}> ?o . ?s <{NS}{TYPE}> ?t }} "
                                  "GROUP BY ?t ORDER BY DESC(?n) ?t LIMIT 1"))
        relations[name] = {"domain": _short(domain[0][0].value) if domain else FALLBACK_TYPE, "range": range_}
    attributes: dict[str, dict[str, str]] = {}
    rows = store.query(f"SELECT DISTINCT ?p (DATATYPE(?o) AS ?d) WHERE {{ ?s ?p ?o . FILTER(isLiteral(?o) && "
                       f"STRSTARTS(STR(?p), \"{NS}\")) }}")
    for p, d in rows:
        name = _short(p.value)
        if d is None or d.value in TEXT_TYPES or name.startswith("type."):
            continue
        attributes[name] = {"datatype": d.value[len(XSD):] if d.value.startswith(XSD) else d.value}
    return {"relations": dict(sorted(relations.items())), "attributes": dict(sorted(attributes.items()))}


def load_ntriples(path: str | Path, data_dir: str = "") -> Path:
    """The store directory for an N-Triples file, loaded now unless a finished one is there (concurrent
    loaders each build in a temp dir; the first rename wins)."""
    src = Path(path).expanduser()
    if not src.is_file():
        raise FileNotFoundError(f"env.kg.ntriples: {src} does not exist")
    final = default_data_dir(data_dir) / "kg" / f"user-{src.stem}-{_digest(src)}"
    if (final / "meta.json").is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    tmp = Path(tempfile.mkdtemp(prefix=".load-", dir=final.parent))
    try:
        store = ox.Store(str(tmp / "store"))
        try:
            store.bulk_load(path=str(src), format=ox.RdfFormat.N_TRIPLES)
        except SyntaxError as exc:
            raise ValueError(f"env.kg.ntriples: {src} is not valid N-Triples: {exc}") from None
        store.optimize()
        ontology = derive_ontology(store)
        triples = len(store)
        del store
        if not ontology["relations"]:
            raise ValueError(f"env.kg.ntriples: {src} has no relation in Freebase's namespace {NS}")
        (tmp / "ontology.json").write_text(json.dumps(ontology, indent=1))
        meta = {"loader": LOADER_VERSION, "source": str(src), "triples": triples,
                "relations": len(ontology["relations"]), "attributes": len(ontology["attributes"]),
                "build_s": round(time.perf_counter() - t0, 2)}
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
        try:
            os.rename(tmp, final)
        except OSError:  # another loader finished first
            shutil.rmtree(tmp, ignore_errors=True)
        log.info("kg_ntriples_loaded", path=str(final), **meta)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def open_ntriples(path: str | Path, data_dir: str = "") -> Graph:
    final = load_ntriples(path, data_dir)
    return Graph(path=final, store=ox.Store.read_only(str(final / "store")),
                 ontology=json.loads((final / "ontology.json").read_text()),
                 meta=json.loads((final / "meta.json").read_text()))
