"""The house rules, enforced: one-way layers, no import cycles, no hidden imports, small files.

The import graph is computed from the source (module-level *and* function-level imports;
only ``if TYPE_CHECKING:`` blocks are left out, since they never run). It fails when:

* any import cycle exists in ``hp_core`` or in a plugin (a function-local import that
  closes a loop is still a loop);
* a module imports one of a higher layer (the table below is the one picture of the
  layers; ``docs/design.md`` prints it);
* an hp module is imported inside a function, except the few places where the
  dependency is optional by design, each listed here with its reason;
* a plugin imports anything of ``hp_core`` outside its public surface;
* a source file holds more than 500 lines.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from hp_core.testing.surface import PUBLIC_SURFACE, private_hp_imports

ROOT = Path(__file__).resolve().parents[1]

#: Layers of hp_core, bottom first. A module may import modules of its own layer or below.
#: The first matching prefix wins, so list a package's special children before the package.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("foundations", ("hp_core.errors", "hp_core.version", "hp_core.bounded")),
    ("spec and mesh", ("hp_core.spec", "hp_core.mesh", "hp_core.context")),
    ("collectives", ("hp_core.collectives",)),
    ("injection decorators", ("hp_core.injection",)),
    ("plugins", ("hp_core.hookspecs", "hp_core.plugins")),
    ("plan", ("hp_core.resolve", "hp_core.plans")),
    ("planner", ("hp_core.planner", "hp_core.plan_items")),
    ("runtime", ("hp_core.runtime",)),
    ("verifier", ("hp_core.verifier",)),
    ("apply", ("hp_core.apply", "hp_core.role_report")),
    ("checkpoint", ("hp_core.checkpoint",)),
    ("public surface", ("hp_core",)),
    (
        "tools",
        (
            "hp_core.artifact",
            "hp_core.training",
            "hp_core.hf_trainer",
            "hp_core.presets",
            "hp_core.scaffold",
            "hp_core.testing",
        ),
    ),
    ("demo", ("hp_core.demo",)),
    ("command line", ("hp_core.cli",)),
)

#: The hp_core modules a plugin may import: the public surface, nothing private (one list,
#: shared with the plugin conformance suite).
PLUGIN_SURFACE = PUBLIC_SURFACE

#: Function-local hp imports that are optional by design: (module, imported) -> why.
OPTIONAL_LOCAL: dict[tuple[str, str], str] = {}

PACKAGES = {
    "hp_core": ROOT / "hp_core",
    "hp_plugin_cp": ROOT / "hp_plugin_cp" / "src" / "hp_plugin_cp",
    "hp_plugin_moe": ROOT / "hp_plugin_moe" / "src" / "hp_plugin_moe",
    "hp_plugin_phi3": ROOT / "plugins" / "hp-plugin-phi3" / "src" / "hp_plugin_phi3",
    "hp_plugin_bloom": ROOT / "plugins" / "hp-plugin-bloom" / "src" / "hp_plugin_bloom",
}


@dataclass(frozen=True)
class Edge:
    source: str
    target: str
    local: bool  # inside a function
    line: int


def _modules(package: str) -> dict[str, Path]:
    root = PACKAGES[package]
    out = {}
    for f in sorted(root.rglob("*.py")):
        parts = [package, *f.relative_to(root).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = f
    return out


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    ids: set[int] = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.If) and "TYPE_CHECKING" in ast.unparse(n.test):
            ids.update(id(c) for c in ast.walk(n))
    return ids


def _function_nodes(tree: ast.AST) -> set[int]:
    ids: set[int] = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef):
            ids.update(id(c) for c in ast.walk(n))
    return ids


def _targets(node: ast.AST, package_of: str) -> list[str]:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if isinstance(node, ast.ImportFrom):
        if node.level:
            base = package_of.split(".")
            base = base[: len(base) - (node.level - 1)]
            mod = ".".join(base + ([node.module] if node.module else []))
        else:
            mod = node.module or ""
        return [mod] + [f"{mod}.{a.name}" for a in node.names]
    return []


def _resolve(name: str, known: dict[str, Path]) -> str | None:
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name or None


def edges(known: dict[str, Path]) -> Iterator[Edge]:
    """Every import from one known module to another (the longest known prefix of each name)."""
    for mod, path in known.items():
        tree = ast.parse(path.read_text())
        skip, funcs = _type_checking_nodes(tree), _function_nodes(tree)
        package_of = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            hits = {_resolve(t, known) for t in _targets(node, package_of)} - {None, mod}
            for hit in sorted(h for h in hits if h is not None):
                yield Edge(mod, hit, id(node) in funcs, getattr(node, "lineno", 0))


def all_modules() -> dict[str, Path]:
    known: dict[str, Path] = {}
    for package in PACKAGES:
        known.update(_modules(package))
    return known


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (iterative Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph.get(start, ()))))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            v, children = work[-1]
            for w in children:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        found.append(sorted(comp))
    return found


def layer_of(module: str) -> int:
    best, depth = -1, -1
    for i, (_, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and len(p) > depth:
                best, depth = i, len(p)
    return best


KNOWN = all_modules()
EDGES = list(edges(KNOWN))


def test_graph_sees_the_codebase() -> None:
    # Negative control for everything below: the graph must actually contain the core's modules and
    # imports, and the cycle finder must find a planted cycle.
    assert len([m for m in KNOWN if m.startswith("hp_core.")]) > 40
    assert len(EDGES) > 100
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles() -> None:
    graph: dict[str, set[str]] = {}
    for e in EDGES:
        graph.setdefault(e.source, set()).add(e.target)
    assert cycles(graph) == []


def test_every_core_module_has_a_layer() -> None:
    unplaced = [m for m in KNOWN if m.startswith("hp_core") and layer_of(m) < 0]
    assert unplaced == [], "add these modules to LAYERS in tests/test_layers.py and docs/design.md"


def test_imports_only_go_down() -> None:
    upward = [
        f"{e.source} (layer {LAYERS[layer_of(e.source)][0]!r}) imports {e.target} "
        f"(layer {LAYERS[layer_of(e.target)][0]!r}) at line {e.line}"
        for e in EDGES
        if e.source.startswith("hp_core")
        and e.target.startswith("hp_core")
        and layer_of(e.target) > layer_of(e.source)
    ]
    assert upward == []


def test_no_hidden_imports() -> None:
    local = [
        f"{e.source}:{e.line} imports {e.target} inside a function"
        for e in EDGES
        if e.local and (e.source, e.target) not in OPTIONAL_LOCAL
    ]
    assert local == []


def test_the_core_never_imports_a_plugin() -> None:
    bad = [
        f"{e.source} -> {e.target}"
        for e in EDGES
        if e.source.startswith("hp_core") and not e.target.startswith("hp_core")
    ]
    assert bad == []


@pytest.mark.parametrize("plugin", [p for p in PACKAGES if p != "hp_core"])
def test_plugins_use_only_the_public_surface(plugin: str) -> None:
    # The same check as the conformance suite's test_imports_only_the_public_hp_core_surface.
    assert private_hp_imports(PACKAGES[plugin]) == []


def test_the_surface_check_catches_private_imports(tmp_path: Path) -> None:
    # Negative control: each kind of private import is found, a public one is not.
    (tmp_path / "mod.py").write_text(
        "from hp_core import Role\n"
        "from hp_core.planner.templates import RoleRule\n"
        "import hp_core.plugins._items\n"
        "from hp_core.plugins import _registry\n"
        "from hp_core import planner\n"
        "def f():\n    from hp_core.runtime import install\n"
    )
    found = [line.split(" imports ")[1] for line in private_hp_imports(tmp_path)]
    assert found == [
        "module hp_core.planner.templates",
        "module hp_core.plugins._items",
        "private name hp_core.plugins._registry",
        "module hp_core.planner",
        "module hp_core.runtime",
    ]
    assert PLUGIN_SURFACE[0] == "hp_core"


def test_no_source_file_over_500_lines() -> None:
    big = [
        f"{p.relative_to(ROOT)}: {n}"
        for p in KNOWN.values()
        if (n := p.read_text().count("\n")) > 500
    ]
    assert big == []


def _documented_layers() -> list[tuple[str, tuple[str, ...]]]:
    text = (ROOT / "docs" / "design.md").read_text()
    block = text.split("<!-- layers: the rows below are read by tests/test_layers.py -->")[1]
    block = block.split("<!-- /layers -->")[0]
    rows = []
    for line in block.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and cells[0].isdigit():
            rows.append((cells[1], tuple(m.strip(" `") for m in cells[2].split(","))))
    return rows


def test_the_design_document_shows_the_enforced_layers() -> None:
    # One table per fact: docs/design.md prints the layer table this test enforces.
    assert _documented_layers() == [(name, tuple(p)) for name, p in LAYERS]
