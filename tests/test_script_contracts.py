"""Every Lua script's header against its description in gateway/redis_io/contracts.py:
ARGV names and order (fixed items, tail, repeated groups), the reply shapes' field
names, one description per script and one script per description; and no script named
by a string literal at a call site (the grammar: contracts.py's docstring)."""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import pytest

from gateway.redis_io import contracts
from gateway.redis_io.contracts import SCRIPTS, Group, Script
from gateway.redis_io.scripts import NAMES

ROOT = Path(__file__).resolve().parent.parent
LUA = ROOT / "lua"
LIBRARIES = {"_prelude", "_subs", "_tenants"}
SCRIPT_NAMES = sorted(p.stem for p in LUA.glob("*.lua") if p.stem not in LIBRARIES)

_SECTION = re.compile(r"-- (\S.*)")  # a section's first line; its others are indented
_ARGV = re.compile(r"ARGV(?: ([a-z][a-z0-9_]*))?:(.*)", re.S)
_ITEM = re.compile(r"(?<![\w.])(\d+)(\.\.)? ([a-z][a-z0-9_]*):")
_FIELD = re.compile(r"([a-z][a-z0-9_]*)(\.\.\.)?(?:\s*\((.*)\))?", re.S)


class HeaderError(ValueError):
    pass


@dataclass
class Args:
    fields: list[str]
    tail: str = ""


@dataclass
class Shape:
    fields: list[str]
    optional: set[str] = field(default_factory=set)
    variadic: str = ""  # the last field's name when it is written ``name...``
    repeats: bool = False  # ``{...}...``


def header(text: str) -> list[str]:
    """The sections of a script's leading comment block, each joined into one line."""
    sections: list[str] = []
    for line in text.splitlines():
        if not line.startswith("--"):
            break
        start = _SECTION.fullmatch(line)
        if start:
            sections.append(start[1])
        elif line.startswith("--  ") and sections:
            sections[-1] += " " + line[2:].strip()
        else:
            raise HeaderError(f"neither a section nor its continuation: {line!r}")
    return sections


def argv_sections(sections: list[str]) -> dict[str, Args]:
    """``-- ARGV:`` ('' in the result) and ``-- ARGV <group>:`` sections, parsed."""
    found: dict[str, Args] = {}
    for section in sections:
        if "ARGV:" in section and not section.startswith("ARGV:"):
            raise HeaderError(f"ARGV inside another section: {section!r}")
        match = _ARGV.fullmatch(section)
        if not match:
            continue
        group, body = match[1] or "", match[2].strip()
        if group in found:
            raise HeaderError(f"two ARGV sections for {group or 'the script'}")
        found[group] = parse_items(body)
    if "" not in found:
        raise HeaderError("no ARGV section")
    return found


def parse_items(body: str) -> Args:
    """``1 name: prose, 2 name: prose, ..., n.. name: prose`` (or ``none.``)."""
    if body == "none.":
        return Args([])
    items = list(_ITEM.finditer(body))
    if not items or items[0].start() != 0:
        raise HeaderError(f"ARGV does not start with an item: {body[:60]!r}")
    args = Args([])
    for n, item in enumerate(items, 1):
        if int(item[1]) != n:
            raise HeaderError(f"item {item[3]!r} is numbered {item[1]}, expected {n}")
        if args.tail:
            raise HeaderError(f"item {item[3]!r} after the tail {args.tail!r}")
        if item[2]:
            args.tail = item[3]
        else:
            args.fields.append(item[3])
    return args


def returns(sections: list[str]) -> str:
    found = [s for s in sections if s.startswith("Returns")]
    if len(found) != 1:
        raise HeaderError(f"{len(found)} Returns sections")
    return found[0]


def _closing(text: str, start: int) -> int:
    """The index of the bracket closing the one at ``start``."""
    depth = 0
    for i in range(start, len(text)):
        if text[i] in "({[":
            depth += 1
        elif text[i] in ")}]":
            depth -= 1
            if depth == 0:
                return i
    raise HeaderError(f"unbalanced: {text[start : start + 60]!r}")


def _split(inner: str) -> list[str]:
    """Fields at commas outside () and {} ([] marks optional fields, not nesting)."""
    parts, depth, start = [], 0, 0
    for i, char in enumerate(inner):
        if char in "({":
            depth += 1
        elif char in ")}":
            depth -= 1
        elif char == "," and depth == 0:
            parts.append(inner[start:i])
            start = i + 1
    parts.append(inner[start:])
    return parts


def shapes(text: str) -> tuple[dict[str, str], list[str]]:
    """The reply shapes of a Returns section, unparsed: tagged ones by status ({'x', ...}),
    and the untagged ones in order (neither inside a field's parentheses)."""
    tagged: dict[str, str] = {}
    untagged: list[str] = []
    i = 0
    while i < len(text):
        if text[i] == "(":
            i = _closing(text, i) + 1
            continue
        if text[i] != "{":
            i += 1
            continue
        end = _closing(text, i)
        whole = text[i : end + 1] + ("..." if text[end + 1 : end + 4] == "..." else "")
        status = re.match(r"\{'([a-z_]+)'", whole)
        if status:
            tagged.setdefault(status[1], whole)
        elif whole.strip("{}.").strip():
            untagged.append(whole)
        i = end + 1
    return tagged, untagged


def parse_shape(whole: str) -> Shape:
    """``{'status', a, b[, c]}``, ``{a, b}...``, ``{'status', a (prose), rest...}``:
    its field names (the status is not one)."""
    repeats = whole.endswith("...")
    inner = whole.removesuffix("...")[1:-1]
    shape = Shape([], repeats=repeats)
    optional = False
    for n, raw in enumerate(_split(inner)):
        part = raw.strip()
        if n == 0 and part.startswith("'"):
            continue  # the status
        if part.startswith("["):
            optional, part = True, part[1:].strip()
        opens = part.endswith("[")  # ``a[, b]``: the fields after this one may be missing
        part = part.removesuffix("[").rstrip("]").strip()  # (``a[, b[, c]]``: nested)
        match = _FIELD.fullmatch(part)
        if not match:
            raise HeaderError(f"not a field name: {part!r} in {whole!r}")
        if shape.variadic:
            raise HeaderError(f"a field after the rest {shape.variadic!r} in {whole!r}")
        shape.fields.append(match[1])
        if optional:
            shape.optional.add(match[1])
        if match[2]:
            shape.variadic = match[1]
        optional = optional or opens
    return shape


def _names(cls: type | None) -> list[str]:
    return list(cls._fields) if cls is not None else []  # type: ignore[attr-defined]


def _is_rest(cls: type, name: str) -> bool:
    """A NamedTuple field that takes the rest of the reply: ``tuple[X, ...]``, last."""
    annotation = getattr(cls, "__annotations__", {}).get(name, "")
    annotation = str(getattr(annotation, "__forward_arg__", annotation))  # a string annotation
    return annotation.startswith("tuple[") and annotation.endswith(", ...]")


def _check_shape(script: str, label: str, cls: type, shape: Shape, tagged: bool) -> list[str]:
    problems = []
    names = _names(cls)
    if tagged:
        if names[:1] != ["status"]:
            problems.append(f"{script} {label}: {cls.__name__}'s first field is not 'status'")
        names = names[1:]
    if names != shape.fields:
        problems.append(f"{script} {label}: header names {shape.fields}, {cls.__name__} has {names}")
        return problems
    defaults = getattr(cls, "_field_defaults", {})
    for name in sorted(shape.optional - set(defaults)):
        problems.append(f"{script} {label}: {name} may be missing, but {cls.__name__} has no default")
    rest = names[-1] if names and _is_rest(cls, names[-1]) else ""
    if rest != shape.variadic:
        problems.append(f"{script} {label}: the rest is {shape.variadic!r} in the header, {rest!r} in Python")
    if rest and not callable(getattr(cls, "of", None)):
        problems.append(f"{script} {label}: {cls.__name__} takes the rest of a reply but has no 'of'")
    return problems


def check(contract: Script, text: str) -> list[str]:
    """What differs between a script's header text and its description ([] none)."""
    name, problems = contract.name, []
    try:
        sections = header(text)
        argv = argv_sections(sections)
        if argv[""].fields != _names(contract.argv):
            problems.append(
                f"{name}: ARGV {argv[''].fields} in the header, {_names(contract.argv)} in Python"
            )
        if argv[""].tail != contract.tail:
            problems.append(f"{name}: tail {argv[''].tail!r} in the header, {contract.tail!r} in Python")
        groups = {g: a for g, a in argv.items() if g}
        if set(groups) != set(contract.groups):
            problems.append(
                f"{name}: groups {sorted(groups)} in the header, {sorted(contract.groups)} in Python"
            )
        tails = {argv[""].tail, *(a.tail for a in groups.values())}
        for group, args in groups.items():
            if group not in tails:
                problems.append(f"{name}: group {group!r} is no tail's")
            if group not in contract.groups:
                continue
            described = contract.groups[group]
            if args.fields != _names(described.fields) or args.tail != described.tail:
                problems.append(
                    f"{name}: ARGV {group} {args.fields} (tail {args.tail!r}) in the header, "
                    f"{_names(described.fields)} (tail {described.tail!r}) in Python"
                )
        if contract.replies or contract.reply:
            tagged, untagged = shapes(returns(sections))
            parsed = {status: parse_shape(whole) for status, whole in tagged.items()}
            for status, cls in contract.replies.items():
                if status not in parsed:
                    problems.append(f"{name}: no {{'{status}', ...}} in the Returns section")
                else:
                    problems += _check_shape(name, repr(status), cls, parsed[status], tagged=True)
            if contract.reply is not None:
                if not untagged:
                    problems.append(f"{name}: no untagged reply in the Returns section")
                else:
                    shape = parse_shape(untagged[0])
                    problems += _check_shape(name, "reply", contract.reply, shape, tagged=False)
                    if shape.repeats != contract.repeats:
                        problems.append(f"{name}: repeats {shape.repeats} in the header, {contract.repeats}")
    except HeaderError as error:
        problems.append(f"{name}: {error}")
    return problems


def source(name: str) -> str:
    return (LUA / f"{name}.lua").read_text()


# -- the scripts against their descriptions -------------------------------------------


def test_every_script_has_one_description_and_every_description_a_script() -> None:
    assert sorted(SCRIPTS) == SCRIPT_NAMES
    assert sorted(NAMES) == SCRIPT_NAMES  # what Scripts registers
    assert all(contract.name == name for name, contract in SCRIPTS.items())
    declared = [value.name for value in vars(contracts).values() if isinstance(value, Script)]
    assert sorted(declared) == SCRIPT_NAMES, "a script declared twice in contracts.py"


@pytest.mark.parametrize("name", SCRIPT_NAMES)
def test_header_matches_description(name: str) -> None:
    assert check(SCRIPTS[name], source(name)) == []


def test_descriptions_are_named_tuples() -> None:
    for contract in SCRIPTS.values():
        classes = [contract.argv, contract.reply, *contract.replies.values()]
        classes += [group.fields for group in contract.groups.values()]
        for cls in classes:
            if cls is not None:
                assert issubclass(cls, tuple) and hasattr(cls, "_fields"), (contract.name, cls)


def test_args_checks_the_count_of_fixed_values() -> None:
    assert contracts.ARCHIVE_LEASE.args("token", 0) == ["token", 0]
    assert contracts.ARCHIVE_FORGET.args("token", "inc", "a", "b") == ["token", "inc", "a", "b"]
    with pytest.raises(TypeError):
        contracts.ARCHIVE_LEASE.args("token", 0, "one too many")
    with pytest.raises(TypeError):
        contracts.ARCHIVE_COMMIT.args("token", "inc")


# -- the parser: strict enough ---------------------------------------------------------

CREATE = source("create")


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ("1 content_type:", "1 media_type:"),  # renamed (a duplicate of the second)
        ("3 ttl_seconds:", "3 ttl:"),  # renamed
        ("23.. entries:", "23.. data:"),  # the tail renamed
        ("23.. entries:", "23 entries:"),  # the tail made a fixed item
        ("4 expires_at_ms:", "5 expires_at_ms:"),  # numbered out of order
        ("{'precondition_failed', tail, created}", "{'precondition_failed', created, tail}"),
        ("{'created', meta}", "{'created', meta[, more]}"),  # a field Python lacks
        ("{'created', meta}", "{'made', meta}"),  # the status Python reads is gone
    ],
)
def test_a_changed_header_fails(old: str, new: str) -> None:
    assert check(SCRIPTS["create"], CREATE) == []
    assert old in CREATE
    assert check(SCRIPTS["create"], CREATE.replace(old, new, 1)) != []


def test_reordered_fields_fail() -> None:
    swapped = CREATE.replace("1 content_type:", "1 SWAP:").replace("2 media_type:", "2 content_type:")
    assert check(SCRIPTS["create"], swapped.replace("1 SWAP:", "1 media_type:")) != []


SYNTHETIC = """-- x.lua: a synthetic header.
-- ARGV: 1 first: the first, 2 second: the second
--   (prose: 3 things), 3.. rest: a group each (ARGV rest).
-- ARGV rest: 1 a: one, 2 b: two.
-- Returns {'ok', tail, types... (per stream)} | {'gone'}.
return 1
"""


class _Argv(NamedTuple):
    first: str
    second: str


class _Rest(NamedTuple):
    a: str
    b: str


class _Ok(NamedTuple):
    status: str
    tail: str
    types: tuple[str, ...]

    @classmethod
    def of(cls, reply: list[str]) -> _Ok:
        return cls(reply[0], reply[1], tuple(reply[2:]))


def test_a_synthetic_header_and_its_negatives() -> None:
    good = Script("x", _Argv, tail="rest", groups={"rest": Group(_Rest)}, replies={"ok": _Ok})
    assert check(good, SYNTHETIC) == []
    assert check(good, SYNTHETIC.replace("1 a: one, 2 b: two", "1 b: two, 2 a: one")) != []  # reordered
    assert check(good, SYNTHETIC.replace("2 second:", "2 other:")) != []  # renamed
    assert check(good, SYNTHETIC.replace("types... (per", "types (per")) != []  # not the rest
    assert check(good, SYNTHETIC.replace("-- ARGV rest: 1 a: one, 2 b: two.\n", "")) != []  # group gone
    assert check(good, SYNTHETIC.replace("2 second:", "2 second")) != []  # an item without its colon
    assert check(good, SYNTHETIC.replace("-- ARGV: ", "-- KEYS: 1 k. ARGV: ")) != []  # hidden in KEYS
    assert check(Script("x", _Argv, tail="rest", replies={"ok": _Ok}), SYNTHETIC) != []  # undescribed group


# -- call sites name scripts through their descriptions --------------------------------

_CALLS = {"run", "run_each", "on_stream", "call", "_call", "_fenced", "source", "register_script"}


def test_no_script_is_named_by_a_string_at_a_call_site() -> None:
    found = []
    for folder in ("gateway", "workers"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path.name == "contracts.py":
                continue
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if not isinstance(node, ast.Call) or not node.args:
                    continue
                func = node.func
                called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
                first = node.args[0]
                if called in _CALLS and isinstance(first, ast.Constant) and first.value in SCRIPTS:
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno} {called}({first.value!r}, ...)")
    assert found == [], "name scripts by their contracts.py description (e.g. CREATE.name)"
