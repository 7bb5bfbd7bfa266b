"""No import cycle anywhere in ``pdkv`` (deferred imports inside functions count too).

The import-linter contracts fix the direction between packages and inside ``pdkv.runtime``; this
test closes the rest: no module reaches itself through the modules it imports."""

from __future__ import annotations

import grimp


def _cycles(graph: grimp.ImportGraph) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    modules = sorted(m for m in graph.modules if m == "pdkv" or m.startswith("pdkv."))
    edges = {m: sorted(graph.find_modules_directly_imported_by(m) & set(modules)) for m in modules}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    counter = 0
    for root in modules:
        if root in index:
            continue
        work = [(root, 0)]
        while work:
            node, i = work.pop()
            if i == 0:
                index[node] = low[node] = counter
                counter += 1
                stack.append(node)
                on_stack.add(node)
            if i < len(edges[node]):
                work.append((node, i + 1))
                nxt = edges[node][i]
                if nxt not in index:
                    work.append((nxt, 0))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            if low[node] == index[node]:
                component = []
                while True:
                    top = stack.pop()
                    on_stack.discard(top)
                    component.append(top)
                    if top == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
    return found


def test_no_module_of_pdkv_imports_itself_through_others() -> None:
    graph = grimp.build_graph("pdkv", include_external_packages=False)
    assert _cycles(graph) == []


def test_the_finder_sees_a_planted_cycle_and_the_real_graph_is_the_package() -> None:
    planted = grimp.ImportGraph()
    for a, b in (("pdkv.a", "pdkv.b"), ("pdkv.b", "pdkv.c"), ("pdkv.c", "pdkv.a"), ("pdkv.c", "pdkv.d")):
        planted.add_import(importer=a, imported=b)
    assert _cycles(planted) == [["pdkv.a", "pdkv.b", "pdkv.c"]]
    real = grimp.build_graph("pdkv", include_external_packages=False)
    assert {"pdkv.runtime.prefill", "pdkv.runtime.channels", "pdkv.protocol.prefill"} <= real.modules
    assert "pdkv.runtime.channels" in real.find_modules_directly_imported_by("pdkv.runtime.prefill")
