"""MkDocs hook (mkdocs.yml, ``hooks:``): the command-line reference is generated, never copied.

A page holds a marker such as ``<!-- options: serve -->``; at build time the marker becomes a
table of every option the ``durable-streams serve`` parser takes (the parser the command
builds, so nothing can drift): flag, environment variable, default and help. For a setting
(a field of ``gateway.config.Settings``) the default, the help and the variables come from its
declaration (``config.SPECS``, ``config.env_names``); for any other option from argparse (its
help's ``[env X; default: Y]`` note goes into the columns). ``<!-- options: archive (own) -->``
lists only the options ``serve`` does not take.

The hook also publishes the load-test figures (``loadtest/results/``, outside ``docs/``) with
the site, so pages link them as ``../loadtest/results/<file>`` (which GitHub renders too).

``python docs/hooks/reference.py [COMMAND...]`` prints the tables (every command's without
arguments); ``tests/test_docs.py`` checks them against ``Settings`` and ``serve --help``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # a checkout without `pip install -e .` (the tests install it)
    sys.path.insert(0, str(ROOT))

from gateway import config  # noqa: E402

# A marker is a line of its own (one inside a sentence or a code span is text).
MARKER = re.compile(r"^<!--\s*options:\s*([\w-]+)\s*(\(own\))?\s*-->[ \t]*$", re.MULTILINE)
RESULTS = "loadtest/results"  # published with the site: pages link ../loadtest/results/<file>
FIGURES = (".png", ".svg")
_NOTE = re.compile(r"\s*\[(?:env (?P<env>\w+))?(?:; )?(?:default: (?P<default>[^\]]*))?\]")


@dataclasses.dataclass(frozen=True)
class Row:
    flags: tuple[str, ...]  # e.g. ("--redis-cluster", "--no-redis-cluster"), or ("STREAM",)
    env: tuple[str, ...]  # the environment variables that set it (the first wins)
    default: str
    help: str
    setting: str | None  # the Settings field, if the option is one


@contextlib.contextmanager
def _clean_environment() -> Iterator[None]:
    """Parsers take their defaults from the environment: build them without it."""
    saved = {k: v for k, v in os.environ.items() if k.startswith(config.ENV_PREFIX) or k == "REDIS_URL"}
    for key in saved:
        del os.environ[key]
    try:
        yield
    finally:
        os.environ.update(saved)


def commands() -> dict[str, argparse.ArgumentParser]:
    """Every ``durable-streams`` subcommand's parser, by name (the entry-point ones included)."""
    from gateway.cli.main import build_parser

    with _clean_environment():
        parser = build_parser()
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    raise RuntimeError("durable-streams has no subcommands")


def _human_bytes(value: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if value >= size and value % size == 0:
            return f"{value // size} {unit}"
    return ""


def _default(name: str, value: Any) -> str:
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return "on" if value else "off"
    if value == "":
        return "empty"
    if isinstance(value, float):
        return f"`{value:g}`"
    if isinstance(value, int) and name.endswith("_bytes") and _human_bytes(value):
        return f"`{value}` ({_human_bytes(value)})"
    return f"`{value}`"


def _setting_row(action: argparse.Action, field: dataclasses.Field[Any]) -> Row:
    return Row(
        tuple(action.option_strings),
        config.env_names(field.name),
        _default(field.name, field.default),
        config.SPECS[field.name].help.replace("%%", "%"),
        field.name,
    )


def _other_row(action: argparse.Action, prog: str) -> Row:
    text = action.help or ""
    with contextlib.suppress(KeyError, TypeError, ValueError):
        text = text % {**vars(action), "prog": prog}
    note = _NOTE.search(text)
    env: tuple[str, ...] = ()
    default = ""
    # e.g. "[env DURABLE_STREAMS_URL; default: http://...]" or "[default: 0]"
    if note and (note["env"] or note["default"]):
        env = (note["env"],) if note["env"] else ()
        default = note["default"] or ""
        default = f"`{default}`" if default and " " not in default else default
        text = (text[: note.start()] + text[note.end() :]).strip()
    if action.default is not None and action.default is not argparse.SUPPRESS and not default:
        default = _default(action.dest, action.default)
    if action.required:
        default = "required"
    flags = tuple(action.option_strings) or (action.metavar or action.dest.upper(),)
    if action.choices and not isinstance(action.choices, dict):
        choices = ", ".join(f"`{choice}`" for choice in action.choices)
        text = f"one of {choices}" + (f": {text}" if text else "")
    return Row(flags, env, default, text, None)


def rows(command: str, own: bool = False) -> list[Row]:
    """The options of ``durable-streams <command>``, in --help order (``own``: not serve's too)."""
    parsers = commands()
    parser = parsers[command]
    served = {flag for action in parsers["serve"]._actions for flag in action.option_strings}
    fields = {f.name: f for f in dataclasses.fields(config.Settings)}
    result = []
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        if own and served.issuperset(action.option_strings) and action.option_strings:
            continue
        field = fields.get(action.dest)
        if field is not None and config.flag_name(field.name) in action.option_strings:
            result.append(_setting_row(action, field))
        else:
            result.append(_other_row(action, parser.prog))
    return result


def _cell(text: str) -> str:
    """Markdown table cell: code spans kept, everything else escaped (<, >, |, *, _)."""
    parts = re.split(r"(`[^`]*`)", text)
    out = []
    for part in parts:
        if part.startswith("`") and part.endswith("`") and len(part) > 1:
            out.append(part.replace("|", "\\|"))
        else:
            part = part.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
            out.append(re.sub(r"([|*_\\\[\]])", r"\\\1", part))
    return "".join(out)


def _variable(name: str) -> str:
    """An environment variable that may wrap at its underscores (and nowhere else)."""
    return '<code class="env">' + name.replace("_", "_<wbr>") + "</code>"


def table(command: str, own: bool = False) -> str:
    """Markdown: a table (in a ``div.options`` that docs/stylesheets/extra.css lays out) of the
    options, each with its environment variables under it, its default and its help."""
    lines = ['<div class="options" markdown>', "", "| option, environment | default | meaning |"]
    lines.append("| --- | --- | --- |")
    for row in rows(command, own):
        option = ", ".join(f"`{flag}`" for flag in row.flags)
        if row.env:
            option += "<br>" + " or ".join(_variable(name) for name in row.env)
        lines.append(f"| {option} | {row.default or '–'} | {_cell(row.help) or '–'} |")
    return "\n".join([*lines, "", "</div>"]) + "\n"


def expand(markdown: str) -> str:
    """Every marker of ``markdown`` replaced by its table; an unknown command is an error."""
    known = commands()

    def replace(match: re.Match[str]) -> str:
        if match[1] not in known:
            raise ValueError(f"<!-- options: {match[1]} -->: durable-streams has no command {match[1]!r}")
        return table(match[1], own=bool(match[2]))

    return MARKER.sub(replace, markdown)


# -- MkDocs events ------------------------------------------------------------------


def on_files(files: Any, config: Any) -> Any:
    """Publish loadtest/results' figures at the same path in the site."""
    from mkdocs.structure.files import File

    for path in sorted((ROOT / RESULTS).rglob("*")):
        if path.suffix in FIGURES:
            src = path.relative_to(ROOT).as_posix()
            files.append(File(src, str(ROOT), config["site_dir"], config["use_directory_urls"]))
    return files


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    depth = page.file.src_uri.count("/")
    markdown = markdown.replace(f"](../{RESULTS}/", f"]({'../' * depth}{RESULTS}/")
    return expand(markdown)


if __name__ == "__main__":
    for name in sys.argv[1:] or list(commands()):
        print(f"## durable-streams {name}\n\n{table(name)}")
