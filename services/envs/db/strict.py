"""What MySQL refuses and SQLite runs, refused on SQLite too (``env.db.mysql_strict``): an agent trained on the
SQLite backend must not be rewarded for SQL that AgentBench's MySQL rejects.

* ``[name]`` identifiers (T-SQL's brackets): MySQL's syntax error.
* MySQL 8.0's reserved words written unquoted where a column or table name goes (``SELECT rank FROM t``,
  ``WHERE order = 1``): a syntax error. Only a word that names a column or table of the database counts, in a
  place where a name goes (after ``SELECT``, ``,``, ``(``, ``.``, ``WHERE``/``AND``/``OR``/``ON``/``SET``/``BY``
  or before a comparison, a ``,`` or ``)``), never a function call (``LEFT(``).
* table names are case-sensitive, as MySQL's on Linux (``lower_case_table_names = 0``): ``FROM employees`` for
  a table ``Employees`` is "Table '...' doesn't exist". Column names stay case-insensitive, as there.
"""

from __future__ import annotations

from collections.abc import Iterable

from services.envs.db.dialect import DialectError, Token

# MySQL 8.0's reserved words (its manual, "Keywords and Reserved Words", the (R) ones)
RESERVED = frozenset("""
accessible add all alter analyze and as asc asensitive before between bigint binary blob both by call cascade case
change char character check collate column condition constraint continue convert create cross cube cume_dist
current_date current_time current_timestamp current_user cursor database databases day_hour day_microsecond
day_minute day_second dec decimal declare default delayed delete dense_rank desc describe deterministic distinct
distinctrow div double drop dual each else elseif empty enclosed escaped except exists exit explain false fetch
first_value float float4 float8 for force foreign from fulltext function generated get grant group grouping groups
having high_priority hour_microsecond hour_minute hour_second if ignore in index infile inner inout insensitive
insert int int1 int2 int3 int4 int8 integer intersect interval into io_after_gtids io_before_gtids is iterate join
json_table key keys kill lag last_value lateral lead leading leave left like limit linear lines load localtime
localtimestamp lock long longblob longtext loop low_priority master_bind master_ssl_verify_server_cert match
maxvalue mediumblob mediumint mediumtext middleint minute_microsecond minute_second mod modifies natural not
no_write_to_binlog nth_value ntile null numeric of on optimize optimizer_costs option optionally or order out
outer outfile over partition percent_rank precision primary procedure purge range rank read reads read_write real
recursive references regexp release rename repeat replace require resignal restrict return revoke right rlike row
row_number rows schema schemas second_microsecond select sensitive separator set show signal smallint spatial
specific sql sqlexception sqlstate sqlwarning sql_big_result sql_calc_found_rows sql_small_result ssl starting
stored straight_join system table terminated then tinyblob tinyint tinytext to trailing trigger true undo union
unique unlock unsigned update usage use using utc_date utc_time utc_timestamp values varbinary varchar varcharacter
varying virtual when where while window with write xor year_month zerofill
""".split())
_NAME_BEFORE = {"select", ",", "(", ".", "where", "and", "or", "on", "set", "by", "not", "=", "<", ">", "<=", ">=",
                "<>", "!=", "<=>"}
_NAME_AFTER = {",", ")", ".", "=", "<", ">", "<=", ">=", "<>", "!=", "<=>"}
_TABLE_BEFORE = {"from", "join", "update", "into", "table"}


def _syntax_error(near: str) -> DialectError:
    return DialectError("You have an error in your SQL syntax; check the manual that corresponds to your MySQL "
                        f"server version for the right syntax to use near '{near[:80]}' at line 1")


def check(sql: str, toks: list[Token], tables: Iterable[str], columns: Iterable[str], database: str) -> None:
    """Raise DialectError, with MySQL's wording, for what MySQL refuses in ``toks`` (``sql``'s tokens)."""
    table_names = list(tables)
    by_lower = {t.lower(): t for t in table_names}
    names = {n.lower() for n in (*table_names, *columns)}
    sig = [t for t in toks if t.kind not in ("space", "comment")]
    in_from = False
    for i, tok in enumerate(sig):
        prev = sig[i - 1].text.lower() if i else ""
        nxt = sig[i + 1].text.lower() if i + 1 < len(sig) else ""
        word = tok.text.lower()
        if tok.kind == "quoted" and tok.text.startswith("["):
            raise _syntax_error(sql[sql.index(tok.text):])
        if tok.kind == "ident" and word in RESERVED and word in names and nxt != "(" and \
                (prev in _NAME_BEFORE or nxt in _NAME_AFTER or i + 1 == len(sig)):
            raise _syntax_error(sql[sql.index(tok.text):])
        if tok.kind in ("ident", "quoted"):
            name = tok.text.strip("`")
            if (prev in _TABLE_BEFORE or (in_from and prev == ",")) and nxt != ".":
                if name not in table_names and name.lower() in by_lower:
                    raise DialectError(f"Table '{database}.{name}' doesn't exist")
        if word in ("from", "join"):
            in_from = True
        elif tok.kind == "ident" and word in ("where", "group", "order", "limit", "having", "on", "union", "set"):
            in_from = False
