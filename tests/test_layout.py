"""The package's import graph: subpackages import "down" only, never in a circle."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "dflow_rt"


def unit(module: str) -> str:
    """The unit a module belongs to: its subpackage (`dflow_rt.train`), or itself at the top level."""
    parts = module.split(".")
    return ".".join(parts[:2]) if (ROOT / parts[1]).is_dir() else module


def import_graph() -> dict[str, set[str]]:
    """unit -> units it imports (module-level and function-level imports alike)."""
    graph: dict[str, set[str]] = {}
    for path in ROOT.rglob("*.py"):
        module = ".".join(("dflow_rt", *path.relative_to(ROOT).with_suffix("").parts)).removesuffix(".__init__")
        if module == "dflow_rt":
            continue  # the public API re-exports everything
        edges = graph.setdefault(unit(module), set())
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module] if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 else []
            edges |= {unit(n) for n in names if n.startswith("dflow_rt.") and unit(n) != unit(module)}
    return graph


def test_import_graph_has_no_cycle():
    graph = import_graph()
    state: dict[str, int] = {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            assert state.get(nxt) != 1, "import cycle: " + " -> ".join([*path, node, nxt])
            if nxt not in state:
                visit(nxt, [*path, node])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [])
    assert {"dflow_rt.train", "dflow_rt.eval", "dflow_rt.data", "dflow_rt.models"} <= graph.keys()
