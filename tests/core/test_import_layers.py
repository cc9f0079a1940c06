"""The layer contracts hold (issue 41, R-… none: this is the code's own
shape). ``lint-imports`` checks the contracts of ``pyproject.toml``; this
test adds what a contract cannot say: no contract sets an import aside,
every module of the product sits in a layer (an unlisted module would be
checked by nothing), and no import circle exists among the product's
modules at all (imports inside functions counted, as grimp counts them)."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

import grimp

from core.config import BASE_DIR

PYPROJECT = tomllib.loads((BASE_DIR / "pyproject.toml").read_text(encoding="utf-8"))
LINTER = PYPROJECT["tool"]["importlinter"]


def _layered_modules() -> list[str]:
    (layers,) = (c for c in LINTER["contracts"] if c["id"] == "layers")
    return [m.strip() for layer in layers["layers"] for m in re.split(r"[:|]", layer) if m.strip()]


def _circles(graph: grimp.ImportGraph) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    modules = sorted(m for m in graph.modules if ".migrations" not in m)
    edges = {m: sorted(i for i in graph.find_modules_directly_imported_by(m) if i in modules) for m in modules}
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


def test_no_contract_sets_an_import_aside():
    """The upward imports the first step listed are gone; a new one is
    fixed by moving code down, passing a callable in or sending a task by
    name, never by listing it."""
    assert [c["id"] for c in LINTER["contracts"] if c.get("ignore_imports")] == []


def test_every_module_sits_in_a_layer():
    graph = grimp.build_graph(*LINTER["root_packages"])
    layered = _layered_modules()
    unlisted = sorted(
        m
        for m in graph.modules
        if "." in m and ".migrations" not in m and not any(m == x or m.startswith(f"{x}.") for x in layered)
    )
    assert unlisted == []


def test_no_import_circle_among_the_products_modules():
    """The audit's circle (thirteen modules: runner > recorder > terminal >
    dispatch > tasks > runner, …) is gone: dispatch sends the worker's task
    by name and the services hand runs over through audit.ledger.handover."""
    graph = grimp.build_graph(*LINTER["root_packages"])
    assert _circles(graph) == []


def test_the_circle_finder_finds_a_circle_and_only_that():
    graph = grimp.ImportGraph()
    for importer, imported in (("app.a", "app.b"), ("app.b", "app.c"), ("app.c", "app.a"), ("app.c", "app.d")):
        graph.add_import(importer=importer, imported=imported, line_number=1, line_contents="import")
    assert _circles(graph) == [["app.a", "app.b", "app.c"]]
    graph.remove_import(importer="app.c", imported="app.a")
    assert _circles(graph) == []
