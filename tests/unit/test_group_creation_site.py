"""Process groups are created in one place: ``comm._world.owned_group`` (which remembers each
for teardown), called by ``comm._groups.new_group`` after the ranks agree.

Walks every module of the package (its syntax tree, not its text) for calls of
``new_group`` / ``init_device_mesh`` / ``DeviceMesh`` in any spelling. Checked against a
planted second call site, so the walk itself can fail.
"""

from __future__ import annotations

import ast
from pathlib import Path

import sbpflow

PACKAGE = Path(sbpflow.__file__).parent
CREATORS = {"new_group", "new_subgroups", "init_device_mesh", "DeviceMesh"}


def _group_creations(source: str) -> list[tuple[str, int]]:
    """(enclosing function, line) of each call of torch's group creators in ``source``: an
    attribute call (``dist.new_group``) or a bare name imported from a torch module."""
    tree = ast.parse(source)
    from_torch = {
        alias.asname or alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torch")
        for alias in node.names
        if alias.name in CREATORS
    }
    found = []

    def visit(node: ast.AST, function: str) -> None:
        for child in ast.iter_child_nodes(node):
            name = function
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = child.name
            if isinstance(child, ast.Call):
                func = child.func
                if (isinstance(func, ast.Attribute) and func.attr in CREATORS) or (
                    isinstance(func, ast.Name) and func.id in from_torch
                ):
                    found.append((function, child.lineno))
            visit(child, name)

    visit(tree, "<module>")
    return found


def _sites() -> dict[str, list[tuple[str, int]]]:
    sites = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        calls = _group_creations(path.read_text())
        if calls:
            sites[str(path.relative_to(PACKAGE))] = calls
    return sites


def test_torch_new_group_is_called_from_one_function_in_comm():
    sites = _sites()
    assert list(sites) == ["comm/_world.py"], sites
    assert [function for function, _ in sites["comm/_world.py"]] == ["owned_group"], sites


def test_the_walk_finds_a_planted_call():
    planted = "import torch.distributed as dist\ndef make():\n    return dist.new_group([0, 1])\n"
    assert _group_creations(planted) == [("make", 3)]
    mesh = "from torch.distributed.device_mesh import init_device_mesh\nm = init_device_mesh('cpu', (2,))\n"
    assert _group_creations(mesh) == [("<module>", 2)]
    own = "from ._groups import new_group\ng = new_group('gloo', [0, 1])\n"
    assert _group_creations(own) == []
