"""No sbpflow module changes another module's globals or another module's classes, except the
one place that adds sbpflow's methods to torch (NOTE [what import sbpflow adds to torch] in
sbpflow/_install.py).

Checked from the source with ``ast``. A module "reaches into" another when it writes
through a name it imported: ``torch.save = ...``, ``other_module.flag = ...``,
``ImportedClass.method = ...``, ``setattr(ImportedClass, ...)``, ``del imported.name``,
``vars(imported)[...] = ...`` or ``imported.__dict__[...] = ...``, at any depth (module
level or inside a function). Writing to its own classes and objects (``self.x = ...``, a
class defined in the module) is not reaching into another module.
"""

from __future__ import annotations

import ast
from pathlib import Path

import sbpflow

from ._packages import write_package

PACKAGE = Path(sbpflow.__file__).resolve().parent

# The one documented place (NOTE [what import sbpflow adds to torch] in sbpflow/_install.py).
ALLOWED = {"sbpflow._install"}


def _module_name(package: Path, path: Path) -> str:
    parts = [package.name, *path.relative_to(package).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported_names(tree: ast.AST) -> set[str]:
    """Every name an import statement binds in this module (at any depth)."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                names.add(alias.asname or alias.name.partition(".")[0])
        elif isinstance(node, ast.ImportFrom):
            for alias in node.names:
                names.add(alias.asname or alias.name)
    return names


def _root(node: ast.expr) -> ast.expr:
    """``a`` for ``a.b.c``, ``a.b[k].c``, ``vars(a)[k]``."""
    while True:
        if isinstance(node, (ast.Attribute, ast.Subscript)):
            node = node.value
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id == "vars"
            and node.args
        ):
            node = node.args[0]
        else:
            return node


def _written_through(target: ast.expr) -> ast.expr | None:
    """The expression whose attribute or ``__dict__`` entry ``target`` writes, or None when
    ``target`` is a plain name (a binding of this module's own)."""
    if isinstance(target, ast.Attribute):
        return target.value
    if isinstance(target, ast.Subscript):
        inner = target.value
        if isinstance(inner, ast.Attribute) and inner.attr == "__dict__":
            return inner.value
        if (
            isinstance(inner, ast.Call)
            and isinstance(inner.func, ast.Name)
            and inner.func.id == "vars"
            and inner.args
        ):
            return inner.args[0]
    return None


_SETTERS = {"setattr", "delattr"}


def _targets(node: ast.AST) -> list[ast.expr]:
    if isinstance(node, ast.Assign):
        out: list[ast.expr] = []
        for target in node.targets:
            out += list(target.elts) if isinstance(target, (ast.Tuple, ast.List)) else [target]
        return out
    if isinstance(node, (ast.AugAssign, ast.AnnAssign)):
        return [node.target]
    if isinstance(node, ast.Delete):
        return list(node.targets)
    if isinstance(node, ast.Call):
        func = node.func
        name = func.id if isinstance(func, ast.Name) else None
        if isinstance(func, ast.Attribute) and func.attr == "__setattr__":
            name = "setattr"  # object.__setattr__(x, ...)
            if node.args:
                return [ast.Attribute(value=node.args[0], attr="?", ctx=ast.Store())]
        if name in _SETTERS and node.args:
            return [ast.Attribute(value=node.args[0], attr="?", ctx=ast.Store())]
    return []


def reaching_writes(package: Path) -> list[str]:
    """``module:line: source`` for each write into another module's globals or classes."""
    found: list[tuple[str, int, str]] = []
    for path in sorted(package.rglob("*.py")):
        module = _module_name(package, path)
        if module in ALLOWED:
            continue
        text = path.read_text()
        tree = ast.parse(text, str(path))
        imported = _imported_names(tree)
        for node in ast.walk(tree):
            for target in _targets(node):
                through = _written_through(target)
                if through is None:
                    continue
                root = _root(through)
                if isinstance(root, ast.Name) and root.id in imported:
                    lineno: int = node.lineno  # type: ignore[attr-defined]
                    found.append((module, lineno, text.splitlines()[lineno - 1].strip()))
    return [f"{module}:{lineno}: {line}" for module, lineno, line in sorted(found)]


def test_no_module_writes_into_another_modules_globals_or_classes() -> None:
    found = reaching_writes(PACKAGE)
    assert not found, (
        "these lines change another module's globals or classes; only sbpflow/_install.py may "
        "(NOTE [what import sbpflow adds to torch]):\n" + "\n".join(found)
    )


def test_the_documented_place_is_the_one_that_adds_to_torch() -> None:
    """The allowed module is real and is the one writing torch's classes."""
    path = PACKAGE / "_install.py"
    tree = ast.parse(path.read_text())
    written = {
        ast.unparse(target)
        for node in ast.walk(tree)
        for target in _targets(node)
        if _written_through(target) is not None
    }
    assert {"torch.Tensor.to_global", "torch.nn.Module.to_global"} <= written


def test_a_bad_module_is_found(tmp_path: Path) -> None:
    """The checker catches each way of reaching into another module, at any depth, and leaves
    a module's own objects alone."""
    package = write_package(
        tmp_path,
        {
            "a": "class A:\n    pass\nflag = 0\n",
            "bad": (
                "import torch\n"
                "from . import a\n"
                "from .a import A\n"
                "torch.Tensor.shout = lambda self: 1\n"  # 4
                "def later():\n"
                "    a.flag = 1\n"  # 6
                "    setattr(A, 'm', None)\n"  # 7
                "    A.n += 1\n"  # 8
                "    del torch.nn.Module.to\n"  # 9
                "    vars(a)['flag'] = 2\n"  # 10
                "    A.__dict__['x'] = 3\n"  # 11
                "    object.__setattr__(A, 'y', 4)\n"  # 12
            ),
            "good": (
                "from .a import A\n"
                "class B:\n    pass\n"
                "setattr(B, 'm', None)\n"
                "B.n = 1\n"
                "def f(x):\n"
                "    x.attr = 1\n"
                "    b = A()\n"
                "    b.attr = 2\n"
                "    return x\n"
            ),
        },
    )
    found = reaching_writes(package)
    assert [f.split(":")[:2] for f in found] == [
        ["pkg.bad", str(n)] for n in (4, 6, 7, 8, 9, 10, 11, 12)
    ]
