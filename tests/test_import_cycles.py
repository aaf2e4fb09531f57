"""No import cycle among memcompile's modules (every import statement, those inside functions too):
the seam (memcompile/_torch_private/) imports plain modules and passes, never the other way round
through a loop."""

import ast
import pathlib

import networkx as nx

ROOT = pathlib.Path(__file__).resolve().parents[1]
# folder -> the import name it installs under (pyproject.toml package-dir)
FOLDERS = {"memcompile": "memcompile", "passes": "memcompile.passes", "cost_models": "memcompile.cost_models"}


def _modules() -> dict[str, pathlib.Path]:
    modules = {}
    for folder, prefix in FOLDERS.items():
        for path in (ROOT / folder).rglob("*.py"):
            parts = [p for p in path.relative_to(ROOT / folder).with_suffix("").parts if p != "__init__"]
            modules[".".join([prefix, *parts])] = path
    return modules


def _imported(node: ast.AST, package: str, modules: dict) -> list[str]:
    """The modules of ours an import statement names (`from a import b`: a.b where b is a module)."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    elif isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:
            parent = package.split(".")[: len(package.split(".")) - node.level + 1]
            base = ".".join(parent + ([base] if base else []))
        names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
    else:
        return []
    found = []
    for name in names:
        while name and name not in modules:  # a name inside a module: that module
            name = name.rpartition(".")[0]
        if name:
            found.append(name)
    return found


def import_graph() -> nx.DiGraph:
    modules = _modules()
    graph = nx.DiGraph()
    for name, path in modules.items():
        graph.add_node(name)
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            graph.add_edges_from((name, target) for target in _imported(node, package, modules) if target != name)
    return graph


def test_no_import_cycle():
    graph = import_graph()
    assert "memcompile._torch_private.lowering" in graph and "memcompile.passes.fusion_refusals" in graph
    assert graph.has_edge("memcompile._torch_private.lowering", "memcompile._torch_private.inductor_hooks")
    cycles = [" -> ".join([*cycle, cycle[0]]) for cycle in nx.simple_cycles(graph)]
    assert not cycles, "\n".join(cycles)
