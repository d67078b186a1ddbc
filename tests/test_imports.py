"""No import circles anywhere in the code, TYPE_CHECKING imports included: a module that
needs something from one that imports it gets what it needs passed in instead (as the
fan-out's ``Watch`` gets a ``Shutdown`` flag, not the ``Fanout``). The layers between
packages are import-linter's contract (pyproject.toml); this is the same rule inside them."""

from __future__ import annotations

import grimp


def circles(graph: grimp.ImportGraph) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph.modules):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.find_modules_directly_imported_by(root))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.find_modules_directly_imported_by(child)))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_no_module_imports_itself_through_others() -> None:
    graph = grimp.build_graph("gateway", "workers", exclude_type_checking_imports=False)
    assert circles(graph) == []


def test_the_check_finds_a_circle() -> None:
    graph = grimp.ImportGraph()
    for module in ("pkg.a", "pkg.b", "pkg.c"):
        graph.add_module(module)
    graph.add_import(importer="pkg.a", imported="pkg.b")
    graph.add_import(importer="pkg.b", imported="pkg.a")
    graph.add_import(importer="pkg.c", imported="pkg.a")
    assert circles(graph) == [["pkg.a", "pkg.b"]]


def test_a_gateway_starts_without_the_parquet_libraries() -> None:
    """pyarrow (and numpy with it) are ~50 MB of RSS per gateway process: imported when an
    archived file is first read or written (archive/files.py), never at start."""
    import subprocess
    import sys

    modules = "{'pyarrow', 'numpy'} & set(sys.modules)"
    check = f"import sys, gateway.cli.main, gateway.http.app; print(sorted({modules}))"
    out = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
