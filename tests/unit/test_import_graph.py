"""sbpflow's intra-package imports form no cycle but the class module's (NOTE [tensor layers] in
sbpflow/_global.py).

The graph is built from the source with ``ast``: every ``import`` statement, at
module level or inside a function, is an edge from the importing module to the
module it names. Two kinds of import are left out, and why:

- ``if TYPE_CHECKING:`` blocks never run, so they cannot take part in a cycle.
- The implicit import of a module's parent packages. Python runs
  ``sbpflow/__init__.py`` before any submodule, and ``__init__`` re-exports
  names from every submodule, so counting it would put every module on a cycle.
  A submodule that imports a *name* from a package's ``__init__`` (rather than
  a submodule) does get an edge to that ``__init__``, so a real cycle through
  a re-export is still caught.
"""

from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx

import sbpflow

from ._packages import write_package

PACKAGE = Path(sbpflow.__file__).resolve().parent


def _modules(package: Path) -> dict[str, tuple[Path, bool]]:
    """Dotted module name -> (file, whether it is a package ``__init__``)."""
    found = {}
    for path in sorted(package.rglob("*.py")):
        parts = [package.name, *path.relative_to(package).with_suffix("").parts]
        is_package = parts[-1] == "__init__"
        if is_package:
            parts = parts[:-1]
        found[".".join(parts)] = (path, is_package)
    return found


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement, at any depth, outside ``if TYPE_CHECKING:`` blocks."""
    out: list[ast.Import | ast.ImportFrom] = []
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and _is_type_checking(node):
            stack.extend(node.orelse)
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            out.append(node)
        stack.extend(ast.iter_child_nodes(node))
    return out


def import_graph(package: Path) -> nx.DiGraph:
    """Edges importer -> imported between the modules of ``package``."""
    modules = _modules(package)
    graph = nx.DiGraph()
    graph.add_nodes_from(modules)
    for name, (path, is_package) in modules.items():
        here = name if is_package else name.rpartition(".")[0]
        for node in _imports(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
                module_object = True
            else:
                if node.level:
                    base = here.split(".")[: len(here.split(".")) - (node.level - 1)]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                # ``from pkg import x``: the submodule ``pkg.x`` if there is one, else pkg itself.
                targets = [
                    f"{source}.{alias.name}" if f"{source}.{alias.name}" in modules else source
                    for alias in node.names
                ]
                module_object = all(f"{source}.{alias.name}" in modules for alias in node.names)
            for target in targets:
                if target in modules and target != name:
                    if graph.has_edge(name, target):  # a name import anywhere makes it one
                        module_object = module_object and graph.edges[name, target]["module_object"]
                    graph.add_edge(name, target, line=node.lineno, module_object=module_object)
    return graph


CLASS_MODULE = "sbpflow._global"


def cycles_besides_the_class_module(graph: nx.DiGraph, class_module: str) -> list[list[str]]:
    """The cycles left once the module-object imports of ``class_module`` are taken out: the
    class module imports the layers its methods run, and they import it back as a module
    object (NOTE [tensor layers])."""
    rest = graph.copy()
    rest.remove_edges_from(
        [(u, v) for u, v, obj in graph.in_edges(class_module, data="module_object") if obj]
    )
    return list(nx.simple_cycles(rest))


def names_read_at_import(graph: nx.DiGraph, class_module: str) -> list[str]:
    """Modules the class module imports (directly or not) that import names from it: those
    would need the class before its module has made it."""
    below = nx.descendants(graph, class_module)
    return sorted(
        f"{u} (line {line})"
        for u, _, line in graph.in_edges(class_module, data="line")
        if u in below and not graph.edges[u, class_module]["module_object"]
    )


def test_sbpflow_imports_have_no_cycle_but_the_class_modules() -> None:
    graph = import_graph(PACKAGE)
    # The graph is the real one: the layers named in DESIGN.md import each other.
    assert graph.has_edge(CLASS_MODULE, "sbpflow._dispatch")
    assert graph.has_edge("sbpflow._dispatch", CLASS_MODULE)
    assert graph.has_edge("sbpflow.tensor", CLASS_MODULE)
    assert graph.has_edge("sbpflow.boxing._redistribute", "sbpflow.boxing.executor")
    cycles = cycles_besides_the_class_module(graph, CLASS_MODULE)
    described = [" -> ".join([*c, c[0]]) for c in sorted(cycles, key=len)[:5]]
    assert not cycles, f"{len(cycles)} import cycle(s), e.g.:\n" + "\n".join(described)
    early = names_read_at_import(graph, CLASS_MODULE)
    assert not early, (
        f"modules {CLASS_MODULE} imports import names from it (use `from . import _global`): "
        + ", ".join(early)
    )


def test_the_class_module_is_imported_first() -> None:
    """``import sbpflow`` imports the class module before any layer that imports it back."""
    tree = ast.parse((PACKAGE / "__init__.py").read_text())
    first = next(node for node in tree.body if isinstance(node, (ast.Import, ast.ImportFrom)))
    assert isinstance(first, ast.ImportFrom) and first.level == 1 and first.module is None
    assert first.names[0].name == CLASS_MODULE.rpartition(".")[2]


def test_a_function_level_import_cycle_is_found(tmp_path: Path) -> None:
    """The checker sees imports inside functions and skips TYPE_CHECKING blocks."""
    package = write_package(
        tmp_path,
        {
            "__init__": "from .a import f\n",
            "a": "def f():\n    from .b import g\n    return g()\n",
            "b": (
                "from typing import TYPE_CHECKING\n"
                "if TYPE_CHECKING:\n    from .c import h\n"
                "def g():\n    from . import a\n    return 1\n"
            ),
            "c": "from .b import g\n",
        },
    )
    graph = import_graph(package)
    assert sorted(map(sorted, nx.simple_cycles(graph))) == [["pkg.a", "pkg.b"]]
    assert not graph.has_edge("pkg.b", "pkg.c")
    # b imports a as a module object: the cycle through a is the class module's kind ...
    assert cycles_besides_the_class_module(graph, "pkg.a") == []
    # ... but not b's, as a imports a name from b.
    assert cycles_besides_the_class_module(graph, "pkg.b") != []
    assert names_read_at_import(graph, "pkg.b") == ["pkg.a (line 2)"]
