"""The package's layout: its import graph (subpackages import "down" only, never in a circle), and
the pages that describe it (every module, every command, the command CI runs)."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "dflow_rt"
BENCH = ROOT.parent / "bench"  # installed as dflow_rt.bench


def modules() -> dict[str, Path]:
    """Every module of the installed package, by name: dflow_rt/ and bench/ (dflow_rt.bench)."""
    out = {}
    for base, prefix in ((ROOT, ("dflow_rt",)), (BENCH, ("dflow_rt", "bench"))):
        for path in base.rglob("*.py"):
            out[".".join((*prefix, *path.relative_to(base).with_suffix("").parts)).removesuffix(".__init__")] = path
    return out


def unit(module: str) -> str:
    """The unit a module belongs to: its innermost subpackage (`dflow_rt.train`, `dflow_rt.kernels.cpu`),
    or itself at the top level."""
    parts = module.split(".")
    if len(parts) > 1 and parts[1] == "bench":
        return "dflow_rt.bench"
    for n in range(len(parts), 1, -1):
        if (ROOT.joinpath(*parts[1:n]) / "__init__.py").exists():
            return ".".join(parts[:n])
    return ".".join(parts[:2])


def imported(node: ast.AST, module: str, is_package: bool = False) -> list[str]:
    """The modules an import statement names, in every form: `import a.b`, `from a import b` (b a
    submodule of a, or a name in a), and relative `from . import b` / `from .a import b`, resolved
    against `module` (a package's `__init__` when `is_package`)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if not isinstance(node, ast.ImportFrom):
        return []
    base = node.module or ""
    if node.level:
        package = module.split(".")[: len(module.split(".")) - node.level + (1 if is_package else 0)]
        base = ".".join([*package, *([base] if base else [])])
    return [base, *(f"{base}.{a.name}" for a in node.names)]


def test_imported_sees_every_import_form():
    def names(source: str, module: str = "dflow_rt.engine.runtime", is_package: bool = False) -> list[str]:
        return imported(ast.parse(source).body[0], module, is_package)

    assert names("import dflow_rt.graphs.plan") == ["dflow_rt.graphs.plan"]
    assert "dflow_rt.models.exact_codes" in names("from dflow_rt.models import exact_codes")
    assert "dflow_rt.oracle" in names("from dflow_rt import oracle")
    assert "dflow_rt.engine.policy" in names("from . import policy")
    assert "dflow_rt.graphs.plan" in names("from ..graphs.plan import x")
    assert "dflow_rt.engine.policy" in names("from .policy import x", "dflow_rt.engine", is_package=True)
    assert unit("dflow_rt.oracle") == "dflow_rt.oracle" and unit("dflow_rt.kernels.cpu.ops") == "dflow_rt.kernels.cpu"


def import_graph() -> dict[str, set[str]]:
    """unit -> units it imports (module-level and function-level imports alike)."""
    graph: dict[str, set[str]] = {}
    for module, path in modules().items():
        if module == "dflow_rt":
            continue  # the public API re-exports everything
        edges = graph.setdefault(unit(module), set())
        for node in ast.walk(ast.parse(path.read_text())):
            found = {n for n in imported(node, module, path.name == "__init__.py") if n.startswith("dflow_rt.")}
            edges |= {unit(n) for n in found if unit(n) != unit(module)}
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
    assert {"dflow_rt.train", "dflow_rt.eval", "dflow_rt.data", "dflow_rt.models", "dflow_rt.bench"} <= graph.keys()


def test_pyproject_installs_every_subpackage_and_bench_as_dflow_rt_bench():
    """The package list is explicit (bench/ maps to dflow_rt.bench), so a new subpackage must join it."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    tool = tomllib.loads((ROOT.parent / "pyproject.toml").read_text())["tool"]["setuptools"]
    found = {"dflow_rt", "dflow_rt.bench"} | {".".join(("dflow_rt", *p.parent.relative_to(ROOT).parts))
                                              for p in ROOT.rglob("*/__init__.py")}
    assert set(tool["packages"]) == found and tool["package-dir"] == {"dflow_rt.bench": "bench"}
    assert not (ROOT / "bench").exists() and (BENCH / "__init__.py").exists()


DOCS = ROOT.parent / "docs"


def test_layout_page_names_every_module():
    """docs/layout.md lists every module of the package."""
    page = (DOCS / "layout.md").read_text()
    missing = [str(p.relative_to(ROOT)) for p in sorted(ROOT.rglob("*.py"))
               if p.name != "__init__.py" and p.name not in page]
    assert not missing, f"docs/layout.md does not name {missing}"


def test_bench_readme_names_every_file_in_bench():
    page = (BENCH / "README.md").read_text()
    missing = [p.name for p in sorted(BENCH.iterdir()) if p.suffix in (".py", ".sh") and p.name != "__init__.py"
               and f"`{p.name}`" not in page]
    assert not missing, f"bench/README.md does not name {missing}"


def test_cli_page_names_every_command():
    """docs/cli.md's synopsis has a line for every `dflow-rt` command and names every `train` command."""
    import argparse

    from dflow_rt.commands.main import parser

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
