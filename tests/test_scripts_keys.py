"""Every key a Lua script touches comes to it in KEYS (and so shares the stream's
hash tag, as keys.py names them): the condition for running the scripts on Redis
Cluster, where a key built inside a script may live on another node, and Redis
only checks the slots of the keys it is told of.

Checked by reading the scripts: the first argument of every ``redis.call`` is a
name bound to KEYS, and names are bound to KEYS only (no string is built into a
key name). The same scripts run on a real cluster in tests/test_cluster.py.
"""

from __future__ import annotations

import re

import pytest

from gateway.redis_io.scripts import NAMES, source

# Commands that take no key.
# PUBLISH takes a channel: the wake channel comes in ARGV (PUBLISH reaches every node).
_KEYLESS = {"TIME", "PUBLISH"}
_CALL = re.compile(r"redis\.p?call\(\s*'([A-Z]+)'\s*(?:,\s*([^,)]+))?")
# Every way a script binds a name: `local a, b = ...`, `a, b = ...`, `for _, a in ...`.
_LOCAL = re.compile(r"^\s*(?:local\s+)?([A-Za-z_][\w]*(?:\s*,\s*[A-Za-z_]\w*)*)\s*=(?!=)\s*(.+)$")
_FOR = re.compile(r"\bfor\s+[\w\s,]*?\b(\w+)\s+in\s+ipairs\((.+?)\)\s+do")


def _code(text: str) -> str:
    """The script without comments (``--`` to the end of a line), a statement continued
    on the next line (after a comma) joined to one line."""
    code = "\n".join(line.split("--", 1)[0].rstrip() for line in text.splitlines())
    return re.sub(r",\n\s*", ", ", code)


def key_names(code: str) -> set[str]:
    """Names bound to KEYS: assigned from KEYS[...] (or from other such names), or a
    loop variable over KEYS or over a table of such names. Fails on a name bound
    to both a key and anything else (a string built from a key, say)."""
    names: set[str] = set()
    others: set[str] = set()
    changed = True
    while changed:
        changed = False
        for line in code.splitlines():
            bound = _LOCAL.match(line)
            if bound:
                targets = [t.strip() for t in bound[1].split(",")]
                values = _split(bound[2])
                for target, value in zip(targets, values, strict=False):
                    value = value.strip()
                    if re.fullmatch(r"KEYS\[[^\]]+\]", value) or value in names:
                        if target not in names:
                            names.add(target)
                            changed = True
                    else:
                        others.add(target)
            for loop in _FOR.finditer(line):
                variable, table = loop[1], loop[2].strip()
                items = [i.strip() for i in table.strip("{}").split(",")]
                if table == "KEYS" or (table.startswith("{") and all(i in names for i in items)):
                    if variable not in names:
                        names.add(variable)
                        changed = True
    mixed = names & others
    assert not mixed, f"bound to a key and to something else: {sorted(mixed)}"
    return names


def _split(values: str) -> list[str]:
    """``a, f(b, c), d`` -> ['a', 'f(b, c)', 'd'] (commas at depth 0 only)."""
    out, depth, current = [], 0, ""
    for ch in values:
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        if ch == "," and depth == 0:
            out.append(current)
            current = ""
        else:
            current += ch
    return [*out, current]


@pytest.mark.parametrize("name", NAMES)
def test_every_key_a_script_touches_is_in_keys(name: str) -> None:
    code = _code(source(name, cluster=True))
    names = key_names(code)
    calls = _CALL.findall(code)
    assert calls, "no redis.call found: the pattern is out of date"
    for command, first in calls:
        if command in _KEYLESS:
            continue
        first = first.strip()
        assert re.fullmatch(r"KEYS\[[^\]]+\]", first) or first in names, (
            f"{name}.lua: {command} on {first!r}, which is not a name bound to KEYS"
        )


def test_the_check_catches_a_key_built_in_lua() -> None:
    """What the old archive scripts did: the segment set's name built from META."""
    built = """
local META = KEYS[1]
local function segs_key(inc) return string.sub(META, 1, #META - 4) .. 'segs:' .. inc end
local segs = segs_key(ARGV[2])
redis.call('ZADD', segs, 1, 'x')
"""
    names = key_names(built)
    assert "segs" not in names
    assert "META" in names
    (command, first), *_ = _CALL.findall(built)
    assert (command, first.strip()) == ("ZADD", "segs")


def test_cluster_scripts_publish_sharded() -> None:
    """On a cluster, notices go out with SPUBLISH (where the server has it); on one
    Redis with PUBLISH only."""
    assert "local CLUSTER = true" in source("append", cluster=True)
    assert "local CLUSTER = false" in source("append", cluster=False)
