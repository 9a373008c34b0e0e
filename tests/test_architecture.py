"""The package's layers: every import points down (or sideways within a layer), and no modules import each other in
a circle. Read from the modules' syntax trees, every import counted: module level, inside functions, and under
``if TYPE_CHECKING:`` (an annotation's arrow back up is a circle too, even if it never runs)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# bottom to top: a module may import its own layer and the layers below it
LAYERS: list[tuple[str, ...]] = [
    ("specexec.errors", "specexec.config", "specexec.home", "specexec.quiet"),
    ("specexec.formats",),
    ("specexec.model",),
    ("offload",),
    ("specexec.loading",),
    ("specexec.steps",),  # the shared step types: tree, sampling, rules, arm and step record, proposal
    ("specexec.propose",),
    ("specexec.policy",),
    ("specexec.decoding",),
    ("specexec.api", "specexec.chat", "specexec.bench", "specexec.doctor", "specexec.quality"),
    ("specexec.server",),
    ("specexec.cli",),
]


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    files = [*ROOT.joinpath("specexec").rglob("*.py"), *ROOT.joinpath("offload").rglob("*.py")]
    return {_module_name(p): p for p in files if "configs" not in p.parts}


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The project modules ``name`` imports (``from a import b`` counts a.b where a.b is a module, else a)."""
    tree = ast.parse(path.read_text())
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name in known)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for a in node.names:
                sub = f"{node.module}.{a.name}"
                if sub in known:
                    out.add(sub)
                elif node.module in known:
                    out.add(node.module)
    out.discard(name)
    return out


def _layer(module: str) -> int | None:
    for i, prefixes in enumerate(LAYERS):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return i
    return None


MODULES = _modules()
GRAPH = {m: _imports(m, p, set(MODULES)) for m, p in MODULES.items()}


def test_every_module_has_a_layer():
    # the packages' __init__ modules that only re-export the public API sit on top
    unplaced = [m for m in MODULES if _layer(m) is None and m not in ("specexec", "offload")]
    assert unplaced == []


@pytest.mark.parametrize("module", sorted(m for m in MODULES if m not in ("specexec", "offload")))
def test_imports_point_down(module):
    mine = _layer(module)
    assert mine is not None
    upward = sorted(dep for dep in GRAPH[module] if (_layer(dep) or 0) > mine and dep not in ("specexec", "offload"))
    assert upward == [], f"{module} (layer {mine}) imports higher layers: {upward}"


def test_no_import_circles():
    """No module reaches itself through the imports of others (Tarjan's strongly connected components)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in GRAPH.get(v, ()):
            if w in ("specexec", "offload"):
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                circles.append(sorted(comp))

    for v in sorted(GRAPH):
        if v not in index:
            visit(v)
    assert circles == []


def test_offload_imports_no_decoding_or_loading():
    """offload/ places weights: it may use the model, the weight formats and the error types, never the engine."""
    allowed = ("offload", "specexec.model", "specexec.formats", "specexec.errors", "specexec.home", "specexec.config")
    for module, deps in GRAPH.items():
        if module.startswith("offload"):
            bad = sorted(d for d in deps if not any(d == a or d.startswith(a + ".") for a in allowed))
            assert bad == [], f"{module} imports {bad}"
