"""The import graph of src/speculant: layers, no cycles, and the picture in the docs.

Every `import speculant...` / `from speculant... import` / relative import of every
module is read with `ast`: those run at import time (module body, `if` / `try` blocks
included, `if TYPE_CHECKING:` left out) and the lazy ones (inside functions and methods,
under TYPE_CHECKING). Checked:

- no cycle between modules among the imports that run at import time (a lazy import
  may close a cycle: `test_lazy_cycles_stay_inside_a_component` lists where one does);
- no cycle between components, lazy imports included;
- no import, lazy or not, from a lower layer into a higher one (`LAYERS`);
- the mermaid picture in docs/how-it-works.md is the graph computed here. To redraw it:
  `python tests/test_layers.py` prints the block to paste.

A component is a top-level module or subpackage of speculant, with two exceptions:
every `cli` module (`speculant.cli`, `speculant.<name>_cli`, `speculant.<package>.cli`)
belongs to the command line, the top layer, and `speculant.eagle.head` (the EAGLE
network the eagle proposer runs) is apart from the rest of `speculant.eagle` (training
and export of heads, which run the engine).
"""

from __future__ import annotations

import ast
from collections.abc import Iterable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "speculant"
DOC = ROOT / "docs" / "how-it-works.md"

# Bottom to top: (layer, what it holds, components). An import may go to a component in
# the same layer or a lower one, never to a higher one.
LAYERS: list[tuple[str, str, tuple[str, ...]]] = [
    (
        "foundations",
        "no model: sampling and the lossless rule, trees, caches, requests, k policy, kernels",
        (
            "sampling",
            "rejection",
            "tree",
            "cache",
            "prefix_cache",
            "requests",
            "adaptive",
            "anomaly",
            "native",
            "argtypes",
        ),
    ),
    (
        "models",
        "models and what reads them",
        ("models", "eagle.head", "detokenize", "scoring", "plan"),
    ),
    ("drafting", "proposers", ("proposers",)),
    ("engine", "scheduling and the engine", ("scheduler", "engine", "cadence")),
    ("front ends", "the Python API and the server", ("speculant", "server")),
    ("tools", "benchmarks, EAGLE training", ("bench", "eagle")),
    ("command line", "every cli module", ("cli",)),
]
LAYER_OF = {c: i for i, (_, _, comps) in enumerate(LAYERS) for c in comps}
LABELS = {"speculant": "speculant (API)", "eagle": "eagle (training)"}

# Import edges: (importer, imported) module names, at import time or lazy.
Edges = set[tuple[str, str]]


def modules() -> dict[str, Path]:
    """speculant's modules by dotted name (a package by its own name)."""
    out = {}
    for path in sorted(SRC.rglob("*.py")):
        parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.Module) -> Iterable[tuple[ast.Import | ast.ImportFrom, bool]]:
    """Every import statement, and whether it runs at import time."""

    def walk(
        nodes: list[ast.stmt], eager: bool
    ) -> Iterable[tuple[ast.Import | ast.ImportFrom, bool]]:
        for node in nodes:
            if isinstance(node, ast.Import | ast.ImportFrom):
                yield node, eager
            elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                yield from walk(node.body, False)
            elif isinstance(node, ast.If) and _is_type_checking(node.test):
                yield from walk(node.body, False)
                yield from walk(node.orelse, eager)
            else:  # class bodies, if / try / with / for blocks: run as the module loads
                for child in ast.iter_child_nodes(node):
                    if isinstance(child, ast.stmt):
                        yield from walk([child], eager)
                    elif isinstance(child, ast.ExceptHandler | ast.match_case):
                        yield from walk(child.body, eager)

    yield from walk(tree.body, True)


def _targets(name: str, node: ast.Import | ast.ImportFrom, mods: dict[str, Path]) -> list[str]:
    """The speculant modules an import statement of module `name` loads (the most
    specific one: `from speculant import native` is speculant.native)."""
    if isinstance(node, ast.Import):
        wanted = [alias.name for alias in node.names]
    else:
        if node.level:
            base = name.split(".")
            if mods[name].name != "__init__.py":
                base.pop()
            base = base[: len(base) - node.level + 1]
            module = ".".join(base + ([node.module] if node.module else []))
        else:
            module = node.module or ""
        wanted = [f"{module}.{alias.name}" for alias in node.names] or [module]
        wanted = [w if w in mods else module for w in wanted]
    out = []
    for target in wanted:
        if target.split(".")[0] != "speculant":
            continue
        while target not in mods:
            target = target.rsplit(".", 1)[0]
        out.append(target)
    return out


def import_edges() -> tuple[Edges, Edges]:
    """(edges at import time, lazy edges) between speculant's modules."""
    mods = modules()
    eager: Edges = set()
    lazy: Edges = set()
    for name, path in mods.items():
        for node, at_import in _imports(ast.parse(path.read_text("utf-8"), str(path))):
            for target in _targets(name, node, mods):
                if target != name:
                    (eager if at_import else lazy).add((name, target))
    return eager, lazy


def component(module: str) -> str:
    parts = module.split(".")
    if parts[-1] == "cli" or parts[-1].endswith("_cli"):
        return "cli"
    if module == "speculant.eagle.head":
        return "eagle.head"
    return parts[1] if len(parts) > 1 else "speculant"


def component_edges(edges: Edges) -> set[tuple[str, str]]:
    return {(component(a), component(b)) for a, b in edges if component(a) != component(b)}


def cycles(edges: Iterable[tuple[str, str]]) -> list[list[str]]:
    """The strongly connected components with more than one node (Tarjan), sorted."""
    graph: dict[str, set[str]] = {}
    for a, b in edges:
        graph.setdefault(a, set()).add(b)
        graph.setdefault(b, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            scc = []
            while True:
                w = stack.pop()
                scc.append(w)
                if w == v:
                    break
            if len(scc) > 1:
                found.append(sorted(scc))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def reduced(edges: set[tuple[str, str]]) -> list[tuple[str, str]]:
    """The transitive reduction of an acyclic graph: an edge implied by a longer path
    is left out (the picture shows what depends on what, not every import)."""
    graph: dict[str, set[str]] = {}
    for a, b in edges:
        graph.setdefault(a, set()).add(b)

    def reachable(start: str, skip: tuple[str, str]) -> set[str]:
        seen: set[str] = set()
        todo = [start]
        while todo:
            v = todo.pop()
            for w in graph.get(v, ()):
                if (v, w) != skip and w not in seen:
                    seen.add(w)
                    todo.append(w)
        return seen

    return sorted((a, b) for a, b in edges if b not in reachable(a, (a, b)))


def mermaid() -> str:
    """The docs' picture: the layers top down, an arrow where a component imports
    another (left out where a path of arrows already leads there)."""
    eager, lazy = import_edges()
    lines = ["graph TD"]

    def node(c: str) -> str:
        ident = c.replace(".", "_")
        return ident if LABELS.get(c, c) == ident else f'{ident}["{LABELS.get(c, c)}"]'

    for i, (name, _, comps) in reversed(list(enumerate(LAYERS))):
        lines.append(f'  subgraph L{i}["{name}"]')
        lines += [f"    {node(c)}" for c in comps]
        lines.append("  end")
    for a, b in reduced(component_edges(eager | lazy)):
        lines.append(f"  {a.replace('.', '_')} --> {b.replace('.', '_')}")
    return "\n".join(lines) + "\n"


def doc_block() -> str | None:
    """The mermaid block of the docs' import-layers section."""
    text = DOC.read_text("utf-8")
    start = text.find("```mermaid\ngraph TD\n  subgraph L")
    if start < 0:
        return None
    body = text[start + len("```mermaid\n") :]
    return body[: body.index("```")]


# ---------------------------------------------------------------- the tests


def test_every_component_has_a_layer() -> None:
    comps = {component(m) for m in modules()}
    missing = sorted(comps - set(LAYER_OF))
    assert not missing, f"add {missing} to a layer in tests/test_layers.py LAYERS"
    gone = sorted(set(LAYER_OF) - comps)
    assert not gone, f"LAYERS names {gone}, which are no longer in src/speculant"


def test_imports_are_read() -> None:
    """The parser sees each kind of import (guards against a silently empty graph)."""
    eager, lazy = import_edges()
    assert ("speculant.engine", "speculant.scheduler") in eager  # from speculant.x import y
    assert ("speculant.proposers", "speculant.proposers.eagle") in eager  # a submodule
    assert ("speculant.bench.pass_cost", "speculant.native") in eager  # from speculant import x
    assert ("speculant.bench.runner", "speculant.eagle.head") in lazy  # inside a function
    assert ("speculant.proposers.base", "speculant.prefix_cache") in lazy  # TYPE_CHECKING


def test_no_cycle_at_import_time() -> None:
    eager, _ = import_edges()
    found = cycles(eager)
    assert not found, f"modules importing each other at import time: {found}"


def test_no_cycle_between_components() -> None:
    eager, lazy = import_edges()
    found = cycles(component_edges(eager | lazy))
    assert not found, f"components importing each other (lazy imports included): {found}"


def test_lazy_cycles_stay_inside_a_component() -> None:
    """Lazy imports close a few cycles between modules; each stays within one component
    (today one, in speculant.models: registry <-> integrity)."""
    eager, lazy = import_edges()
    for scc in cycles(eager | lazy):
        assert len({component(m) for m in scc}) == 1, f"a cycle across components: {scc}"


def test_no_import_from_a_lower_layer_into_a_higher_one() -> None:
    eager, lazy = import_edges()
    wrong = sorted(
        f"{a} -> {b} ({LAYERS[LAYER_OF[component(a)]][0]} -> {LAYERS[LAYER_OF[component(b)]][0]})"
        for a, b in eager | lazy
        if component(a) in LAYER_OF
        and component(b) in LAYER_OF
        and LAYER_OF[component(a)] < LAYER_OF[component(b)]
    )
    assert not wrong, "imports into a higher layer:\n" + "\n".join(wrong)


def test_the_picture_in_the_docs_is_the_graph() -> None:
    block = doc_block()
    assert block == mermaid(), (
        "the import-layers picture in docs/how-it-works.md differs from the code's graph: "
        "run `python tests/test_layers.py` and paste its block into the doc"
    )


if __name__ == "__main__":
    print("```mermaid\n" + mermaid() + "```")
