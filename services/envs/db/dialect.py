"""MySQL's dialect on SQLite: what the agent writes for MySQL (it is told it talks to MySQL) means the same here.

SQLite runs most of MySQL's SELECT/INSERT/UPDATE/DELETE as written; these differences changed answers
(AgentBench's data is MySQL's, its tables all TEXT columns):

* string literals: MySQL reads backslash escapes (``'a\\nb'`` is a newline) and takes ``"..."`` as a
  string (sql_mode ''); SQLite reads both verbatim / as an identifier. ``translate`` rewrites literals
  to SQLite's form. ``\\%`` and ``\\_`` keep their backslash, as in MySQL, for LIKE (see ``like``).
* identifiers that start with a digit (``1st_place``) are legal unquoted in MySQL; SQLite reads a number
  followed by garbage, so ``translate`` quotes them.
* ``#`` starts a comment in MySQL.
* a string column compared with a number is compared as a number in MySQL (``'10' > 9``), as text in
  SQLite (the TEXT affinity converts the number). ``translate`` wraps the column in ``CAST(... AS REAL)``
  when one side of a comparison is a bare identifier and the other a numeric literal: SQLite's CAST takes
  the leading number of a string and 0 otherwise, which is MySQL's conversion.
* ``SUM`` over strings is a DOUBLE in MySQL, an integer in SQLite when the strings look like integers.
* ``FROM 'name'`` is a table in SQLite, a syntax error in MySQL: ``translate`` raises ``DialectError``.
* text comparison: MySQL's default collation (utf8mb4_general_ci / _0900_ai_ci) ignores case, accents
  and trailing spaces (``'Montreal' = 'MONTRÉAL '``). TEXT columns are declared ``COLLATE mysql_ci``
  (``collation_key`` below, registered on each connection), and LIKE is replaced by a function with
  the same folding and MySQL's default escape character ``\\``.
"""

from __future__ import annotations

import functools
import re
import sqlite3
import unicodedata
from collections.abc import Iterator
from typing import NamedTuple

COLLATION = "mysql_ci"

_ESCAPES = {"0": "\0", "'": "'", '"': '"', "b": "\b", "n": "\n", "r": "\r", "t": "\t", "Z": "\x1a",
            "\\": "\\", "%": "\\%", "_": "\\_"}


class Token(NamedTuple):
    kind: str  # string | ident | quoted | number | op | space | comment | other
    text: str


_TOKEN = re.compile(r"""
    (?P<space>\s+)
  | (?P<comment>--(?:\s[^\n]*)?(?:\n|$)|\#[^\n]*(?:\n|$)|/\*.*?(?:\*/|$))
  | (?P<string>'(?:[^'\\]|\\.|'')*'?|"(?:[^"\\]|\\.|"")*"?)
  | (?P<quoted>`(?:[^`]|``)*`?|\[[^\]]*\]?)
  | (?P<number>0x[0-9a-fA-F]+\b|(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?(?![\w$]))
  | (?P<ident>[\w$]+)
  | (?P<op><=>|<=|>=|<>|!=|==|\|\||[=<>])
  | (?P<other>.)
""", re.X | re.S)


def tokens(sql: str) -> Iterator[Token]:
    for m in _TOKEN.finditer(sql):
        kind = m.lastgroup or "other"
        yield Token(kind, m.group())


def unescape(body: str, quote: str) -> str:
    """The value of a MySQL string literal's body (between its quotes)."""
    out, i = [], 0
    while i < len(body):
        ch = body[i]
        if ch == "\\" and i + 1 < len(body):
            nxt = body[i + 1]
            out.append(_ESCAPES.get(nxt, nxt))  # an unknown escape is the character itself
            i += 2
        elif ch == quote and body[i + 1: i + 2] == quote:
            out.append(quote)
            i += 2
        else:
            out.append(ch)
            i += 1
    return "".join(out)


def sqlite_literal(value: str) -> str:
    return "'" + value.replace("'", "''") + "'"


_COMPARE = {"=", "<=>", "<", "<=", ">", ">=", "<>", "!=", "=="}
_KEYWORDS_BEFORE_VALUE = {"select", "where", "and", "or", "not", "on", "having", "when", "then", "else", "by",
                          "set", "values", "in", "between", "like", "is", "case", "limit", "offset", "null", "true", "false",
                          "distinct", "from", "as", "asc", "desc", "group", "order", "rows", "range", "groups",
                          "preceding", "following", "unbounded", "current", "row", "over", "partition", "end",
                          "exists", "any", "all", "some", "interval", "escape", "join", "using"}


def _column_ref(toks: list[Token], end: int) -> int:
    """Start index of a column reference (``a``, ```a```, ``t.a``) ending at toks[end], or -1."""
    if toks[end].kind not in ("ident", "quoted") or toks[end].text.lower() in _KEYWORDS_BEFORE_VALUE:
        return -1
    start = end
    while start >= 2 and toks[start - 1].text == "." and toks[start - 2].kind in ("ident", "quoted"):
        start -= 2
    return start


def _prev(toks: list[Token], i: int) -> int:
    i -= 1
    while i >= 0 and toks[i].kind in ("space", "comment"):
        i -= 1
    return i


def _next(toks: list[Token], i: int) -> int:
    i += 1
    while i < len(toks) and toks[i].kind in ("space", "comment"):
        i += 1
    return i


class DialectError(ValueError):
    """A statement MySQL refuses that SQLite would run (with MySQL's wording)."""


_TABLE_KEYWORDS = {"from", "join", "update"}


def translate(sql: str) -> str:
    """MySQL statement -> SQLite statement with the same meaning (see the module docstring)."""
    toks: list[Token] = []
    for tok in tokens(sql):
        if tok.kind == "string" and toks and toks[_prev(toks, len(toks))].text.lower() in _TABLE_KEYWORDS:
            # SQLite takes FROM 'name' as a table name; MySQL refuses it
            near = sql[sql.index(tok.text):][:80]
            raise DialectError("You have an error in your SQL syntax; check the manual that corresponds to your "
                               f"MySQL server version for the right syntax to use near '{near}' at line 1")
        if tok.kind == "string" and len(tok.text) >= 2 and tok.text[-1] == tok.text[0]:
            toks.append(Token("string", sqlite_literal(unescape(tok.text[1:-1], tok.text[0]))))
        elif tok.kind == "comment" and tok.text.startswith("#"):
            toks.append(Token("space", " "))
        elif tok.kind == "ident" and tok.text[0].isdigit() and not tok.text.isdigit():
            toks.append(Token("quoted", "`" + tok.text + "`"))  # 1st_place, 2010s
        elif tok.kind == "quoted" and tok.text.startswith("["):
            toks.append(tok)  # SQLite reads [name] as an identifier too (MySQL does not; its error stays ours)
        else:
            toks.append(tok)
    # a string column compared with a number compares as numbers (MySQL's conversion)
    wrap: dict[int, int] = {}  # start token -> end token of a column reference to cast
    if toks and toks[_next(toks, -1)].text.lower() in ("pragma", "set"):
        return "".join(t.text for t in toks)
    depth, assign_depth = 0, -1  # the nesting level of an UPDATE's SET list (its `=` assign, not compare)
    for i, tok in enumerate(toks):
        word = tok.text.lower() if tok.kind == "ident" else ""
        depth += tok.text == "("
        depth -= tok.text == ")"
        if word == "set" or (word == "update" and toks[_prev(toks, i)].text.lower() == "key"):
            assign_depth = depth
        elif word in ("where", "order", "limit", "returning") and depth <= assign_depth or depth < assign_depth:
            assign_depth = -1
        if assign_depth == depth and tok.text == "=":
            continue
        if word in ("between", "in"):  # col [NOT] BETWEEN 1 AND 5, col [NOT] IN (1, 2)
            left, right = _prev(toks, i), _next(toks, i)
            if left >= 0 and toks[left].text.lower() == "not":
                left = _prev(toks, left)
            if word == "in" and right < len(toks) and toks[right].text == "(":
                right = _next(toks, right)
            if right < len(toks) and toks[right].text in ("-", "+"):
                right = _next(toks, right)
            if left >= 0 and right < len(toks) and toks[right].kind == "number":
                start = _column_ref(toks, left)
                if start >= 0:
                    wrap[start] = left
            continue
        if tok.kind != "op" or tok.text not in _COMPARE:
            continue
        left, right = _prev(toks, i), _next(toks, i)
        if left < 0 or right >= len(toks):
            continue
        sign = right
        if toks[right].text in ("-", "+"):
            sign = _next(toks, right)
        if sign < len(toks) and toks[sign].kind == "number" and not toks[sign].text.startswith("0x"):
            start = _column_ref(toks, left)
            if start >= 0:
                wrap[start] = left
        elif toks[left].kind == "number":
            start = _column_ref(toks, right) if toks[right].kind in ("ident", "quoted") else -1
            end = right
            while start >= 0 and end + 2 < len(toks) and toks[end + 1].text == "." and \
                    toks[end + 2].kind in ("ident", "quoted"):
                end += 2
            nxt = _next(toks, end)
            if start >= 0 and not (nxt < len(toks) and toks[nxt].text == "("):  # not a function call
                wrap[start] = end
    out: list[str] = []
    closing: set[int] = set()
    for i, tok in enumerate(toks):
        if i in wrap:
            out.append("CAST(")
            closing.add(wrap[i])
        out.append(tok.text)
        if i in closing:
            out.append(" AS REAL)")
    return "".join(out)


@functools.lru_cache(maxsize=65536)
def collation_key(text: str) -> str:
    """MySQL's ``_ci``/``_ai`` equality: case and accents folded, trailing spaces ignored (PAD SPACE)."""
    decomposed = unicodedata.normalize("NFKD", text)
    return "".join(ch for ch in decomposed if not unicodedata.combining(ch)).casefold().rstrip(" ")


def collate(a: str, b: str) -> int:
    ka, kb = collation_key(a), collation_key(b)
    return (ka > kb) - (ka < kb)


@functools.lru_cache(maxsize=4096)
def _like_regex(pattern: str, escape: str) -> re.Pattern[str]:
    out, i = [], 0
    while i < len(pattern):
        ch = pattern[i]
        if ch == escape and i + 1 < len(pattern):
            out.append(re.escape(collation_key(pattern[i + 1]) or pattern[i + 1]))
            i += 2
            continue
        out.append(".*" if ch == "%" else "." if ch == "_" else re.escape(collation_key(ch) if ch != " " else ch))
        i += 1
    return re.compile("".join(out), re.S)


def like(pattern: object, value: object, escape: object = "\\") -> int | None:
    """SQLite calls ``like(pattern, value[, escape])`` for ``value LIKE pattern [ESCAPE e]``."""
    if pattern is None or value is None:
        return None
    folded = "".join(collation_key(ch) if ch != " " else ch for ch in str(value))
    return 1 if _like_regex(str(pattern), str(escape or "\\")).fullmatch(folded) else 0


_LEADING_NUMBER = re.compile(r"\s*[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?")


def mysql_number(text: str) -> float:
    """MySQL's string-to-number conversion: the leading number, 0 when there is none."""
    m = _LEADING_NUMBER.match(text)
    return float(m.group()) if m else 0.0


class Sum:
    """MySQL's SUM: a DOUBLE as soon as a string (or float) is summed (AgentBench's columns are all TEXT),
    where SQLite gives an integer for integer-looking strings. Also a window function (``SUM(x) OVER``)."""

    def __init__(self) -> None:
        self.total: int | float = 0
        self.floating = 0  # non-integer values in the frame
        self.seen = 0  # non-NULL values in the frame

    @staticmethod
    def _number(value: object) -> int | float:
        if isinstance(value, int):
            return value
        return mysql_number(value) if isinstance(value, str) else float(value)  # type: ignore[arg-type]

    def step(self, value: object) -> None:
        if value is None:
            return
        self.seen += 1
        self.floating += not isinstance(value, int)
        self.total += self._number(value)

    def inverse(self, value: object) -> None:  # a row leaves the window frame
        if value is None:
            return
        self.seen -= 1
        self.floating -= not isinstance(value, int)
        self.total -= self._number(value)

    def value(self) -> int | float | None:
        if not self.seen:
            return None
        return float(self.total) if self.floating else self.total

    def finalize(self) -> int | float | None:
        return self.value()


def install(conn: sqlite3.Connection) -> None:
    """Register the collation, LIKE and SUM on a connection (before tables that use the collation exist)."""
    conn.create_collation(COLLATION, collate)
    conn.create_function("like", 2, like, deterministic=True)
    conn.create_function("like", 3, like, deterministic=True)
    if hasattr(conn, "create_window_function"):  # SQLite >= 3.25: SUM(x) OVER (...) keeps working
        conn.create_window_function("sum", 1, Sum)  # type: ignore[arg-type]
    else:
        conn.create_aggregate("sum", 1, Sum)  # type: ignore[arg-type]
