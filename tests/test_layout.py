"""The package's layout: its import graph (subpackages import "down" only, never in a circle), and
the pages that describe it (every module, every command, the command CI runs)."""

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


DOCS = ROOT.parent / "docs"


def test_layout_page_names_every_module():
    """docs/layout.md lists every module of the package."""
    page = (DOCS / "layout.md").read_text()
    missing = [str(p.relative_to(ROOT)) for p in sorted(ROOT.rglob("*.py"))
               if p.name != "__init__.py" and p.name not in page]
    assert not missing, f"docs/layout.md does not name {missing}"


def test_cli_page_names_every_command():
    """docs/cli.md's synopsis has a line for every `dflow-rt` command and names every `train` command."""
    import argparse

    from dflow_rt.cli import parser

    def commands(p: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
        return next(a for a in p._actions if isinstance(a, argparse._SubParsersAction)).choices

    synopsis = (DOCS / "cli.md").read_text().split("```")[1]
    top = commands(parser())
    for name in top:
        assert f"\ndflow-rt {name} " in synopsis, f"docs/cli.md's synopsis lacks `dflow-rt {name}`"
    assert "dflow-rt train " + "|".join(commands(top["train"])) + " " in synopsis


def test_readme_shows_the_command_ci_runs():
    """The README's test command is the one .ci/run runs, byte for byte."""
    ci = (ROOT.parent / ".ci" / "run").read_text()
    command = 'pip install -e ".[test]" && python -m pytest -q'
    assert f"\n{command}\n" in ci and f"\n{command}\n" in (ROOT.parent / "README.md").read_text()
