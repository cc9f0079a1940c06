"""The layer contracts hold (issue 41, R-… none: this is the code's own
shape). ``lint-imports`` checks the contracts of ``pyproject.toml``; this
test adds what a contract cannot say: no import circle among the product's
modules at all (imports inside functions counted, as grimp counts them),
once today's listed upward imports are set aside, and that list only
shrinks."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

import grimp

from yuxi_project.config import BASE_DIR

PYPROJECT = tomllib.loads((BASE_DIR / "pyproject.toml").read_text(encoding="utf-8"))
LINTER = PYPROJECT["tool"]["importlinter"]
# The upward imports of today, as the layers contract lists them. Each
# later step moves code and lowers this number; none raises it.
MOST_IGNORED = 17


def _ignored() -> set[tuple[str, str]]:
    (layers,) = (c for c in LINTER["contracts"] if c["id"] == "layers")
    return {tuple(re.split(r"\s*->\s*", entry)) for entry in layers["ignore_imports"]}


def _circles(graph: grimp.ImportGraph, ignored: set[tuple[str, str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    modules = sorted(m for m in graph.modules if ".migrations" not in m)
    edges = {
        m: sorted(i for i in graph.find_modules_directly_imported_by(m) if (m, i) not in ignored and i in modules)
        for m in modules
    }
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles = []
    for root in modules:
        if root in index:
            continue
        work = [(root, 0)]
        while work:
            node, child = work.pop()
            if child == 0:
                index[node] = low[node] = len(index)
                stack.append(node)
                on_stack.add(node)
            for position in range(child, len(edges[node])):
                target = edges[node][position]
                if target not in index:
                    work += [(node, position + 1), (target, 0)]
                    break
                if target in on_stack:
                    low[node] = min(low[node], index[target])
            else:
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        circles.append(sorted(component))
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[node])
    return circles


def test_the_layer_contracts_hold():
    lint = Path(sys.executable).with_name("lint-imports")
    done = subprocess.run([lint, "--no-cache"], cwd=BASE_DIR, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]


def test_no_import_circle_beyond_the_listed_upward_imports():
    graph = grimp.build_graph(*LINTER["root_packages"])
    assert _circles(graph, _ignored()) == []


def test_no_import_circle_even_counting_the_listed_upward_imports():
    """The audit's circle (thirteen modules: runner > recorder > terminal >
    dispatch > tasks > runner, …) is gone: dispatch sends the worker's task
    by name and the services hand runs over through audit.handover."""
    graph = grimp.build_graph(*LINTER["root_packages"])
    assert _circles(graph, set()) == []


def test_the_circle_finder_finds_a_circle_and_only_that():
    graph = grimp.ImportGraph()
    for importer, imported in (("app.a", "app.b"), ("app.b", "app.c"), ("app.c", "app.a"), ("app.c", "app.d")):
        graph.add_import(importer=importer, imported=imported, line_number=1, line_contents="import")
    assert _circles(graph, set()) == [["app.a", "app.b", "app.c"]]
    assert _circles(graph, {("app.c", "app.a")}) == []


def test_the_list_of_upward_imports_only_shrinks():
    assert len(_ignored()) <= MOST_IGNORED, "a new upward import: move the code down instead of listing it"
