"""The manual (mkdocs.yml, docs/) documents every setting: the configuration reference is
generated from gateway/config.py by docs/hooks/reference.py at build time, and these tests fail
when a setting has no help, when the reference leaves a setting or a `serve --help` flag out,
when a command has no table, or when a page is missing from the nav. (`mkdocs build --strict`,
in tests/run.sh, checks links and anchors.)"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from dataclasses import fields
from pathlib import Path
from types import ModuleType

import pytest
import yaml

from gateway import config

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")


def _reference() -> ModuleType:
    path = DOCS / "hooks" / "reference.py"
    spec = importlib.util.spec_from_file_location("docs_reference", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


reference = _reference()


def _pages() -> dict[str, str]:
    return {p.relative_to(DOCS).as_posix(): p.read_text() for p in DOCS.rglob("*.md")}


def _rows(markdown: str) -> list[tuple[list[str], str, str]]:
    """The option rows of ``markdown`` (after the hook): (flags, environment cell, meaning)."""
    markdown = re.sub(r'<code class="env">(.*?)</code>', r"`\1`", markdown).replace("<wbr>", "")
    rows = []
    for line in markdown.splitlines():
        if line.startswith("| `"):
            option, _default, meaning = (cell.strip() for cell in re.split(r"(?<!\\)\|", line)[1:-1])
            flags, _, env = option.partition("<br>")
            rows.append(([flag.strip("`") for flag in flags.split(", ")], env, meaning))
    return rows


def test_every_setting_has_help() -> None:
    names = [f.name for f in fields(config.Settings)]
    assert list(config.SPECS) == names, "a Settings field is not declared with config.setting"
    empty = [name for name in names if not config.SPECS[name].help.strip()]
    assert not empty, f"settings without help text: {empty}"


def test_every_setting_is_in_the_configuration_reference() -> None:
    page = reference.expand((DOCS / "configuration.md").read_text())
    rows = _rows(page)
    missing = []
    for f in fields(config.Settings):
        flag, env = config.flag_name(f.name), f"`{config.env_name(f.name)}`"
        if not any(flag in flags and env in variables and meaning for flags, variables, meaning in rows):
            missing.append(config.flag_name(f.name))
    assert not missing, f"settings missing from docs/configuration.md's generated tables: {missing}"


def test_every_flag_of_serve_help_is_in_the_reference() -> None:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(config.ENV_PREFIX) and k != "REDIS_URL"}
    shown = subprocess.run(
        [sys.executable, "-m", "gateway", "serve", "--help"],
        env={**clean, "COLUMNS": "200"},
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout
    flags = set(FLAG.findall(shown)) - {"--help"}
    assert "--redis-url" in flags and "--no-archive-hints" in flags  # the help was read
    page = reference.expand((DOCS / "configuration.md").read_text())
    serve = page.split("## The gateway: `durable-streams serve`", 1)[1].split("\n## ", 1)[0]
    listed = {flag for flags, _, _ in _rows(serve) for flag in flags}
    assert not flags - listed, f"`serve --help` flags missing from the reference: {sorted(flags - listed)}"


def test_every_command_has_a_table() -> None:
    """Each `durable-streams` command's options are on some page (settings: configuration.md)."""
    pages = _pages()
    marked: dict[str, set[str]] = {}
    for name, text in pages.items():
        for match in reference.MARKER.finditer(text):
            marked.setdefault(match[1], set()).add(name)
    commands = reference.commands()
    unmarked = set(commands) - set(marked)
    assert not unmarked, f"commands without an options table: {unmarked}"
    settings = {f.name for f in fields(config.Settings)}
    for name, parser in commands.items():
        if any(config.flag_name(a.dest) in a.option_strings for a in parser._actions if a.dest in settings):
            assert "configuration.md" in marked[name], f"{name} takes settings: table it there"


def test_markers_name_real_commands() -> None:
    for name, text in _pages().items():
        reference.expand(text)  # raises on an unknown command
        lines = [line for line in text.splitlines() if line.startswith("<!-- options")]
        bad = [line for line in lines if not reference.MARKER.fullmatch(line)]
        assert not bad, f"{name}: markers the hook would leave as they are: {bad}"


@pytest.mark.parametrize("command", ["serve", "archive", "deliver"])
def test_tables_show_defaults_from_settings(command: str) -> None:
    """Defaults come from Settings, not from the environment of whoever builds the site."""
    os.environ["DURABLE_STREAMS_PORT"] = "9999"
    try:
        rows = {row.flags[0]: row for row in reference.rows(command)}
    finally:
        del os.environ["DURABLE_STREAMS_PORT"]
    assert rows["--host"].default == "`127.0.0.1`"
    if command == "serve":
        assert rows["--port"].default == "`4437`"
        assert rows["--max-body-bytes"].default == "`67108864` (64 MiB)"
        assert rows["--redis-url"].env == ("DURABLE_STREAMS_REDIS_URL", "REDIS_URL")


def test_every_page_is_in_the_nav() -> None:
    site = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    assert site["docs_dir"] == "docs"

    def walk(node: object) -> list[str]:
        if isinstance(node, str):
            return [node]
        if isinstance(node, list):
            return [page for item in node for page in walk(item)]
        if isinstance(node, dict):
            return [page for value in node.values() for page in walk(value)]
        return []

    nav = walk(site["nav"])
    assert sorted(nav) == sorted(set(nav)), "a page is in the nav twice"
    assert set(nav) == set(_pages()), f"pages and nav differ: {set(nav) ^ set(_pages())}"
