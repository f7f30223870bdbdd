"""API signature blocks (``<!-- run: signature -->``) against the code they document.

A block lists signatures as the API reference writes them, one per line (continued on
indented lines, comments allowed)::

    sbpflow.randn(*size, placement: Placement, sbp, dtype: torch.dtype | None = None,
                  requires_grad: bool = False) -> GlobalTensor

Each must name an importable object whose parameters have the same names, kinds
(positional, keyword-only, ``*args``, ``**kwargs``) and defaults, in the same order.
Annotations are the reader's help and are not compared.
"""

from __future__ import annotations

import ast
import importlib
import inspect
from typing import Any

Parameter = tuple[str, str, "str | None"]  # name, inspect kind name, default as source


def _resolve(dotted: str) -> Any:
    """``sbpflow.boxing.plan`` -> the object: attributes from the top, importing submodules
    that are not attributes yet (``sbpflow.placement`` is the function, not the module)."""
    import sbpflow  # noqa: F401 - adds torch.Tensor.to_global and torch.nn.Module.to_global

    parts = dotted.split(".")
    obj = importlib.import_module(parts[0])
    for depth, attribute in enumerate(parts[1:], start=2):
        if hasattr(obj, attribute):
            obj = getattr(obj, attribute)
        else:
            obj = importlib.import_module(".".join(parts[:depth]))
    return obj


def _documented(entry: str) -> tuple[str, ast.arguments]:
    """``name(params) -> result`` -> (name, the parameters as Python parses them)."""
    name, _, rest = entry.partition("(")
    params = rest[: rest.rindex(")")]
    tree = ast.parse(f"def _({params}): ...")
    function = tree.body[0]
    assert isinstance(function, ast.FunctionDef)
    return name.strip(), function.args


def _parameters(args: ast.arguments) -> list[Parameter]:
    """(name, kind, default as source) in order, with inspect's kind names."""
    positional = [*args.posonlyargs, *args.args]
    defaults = [None] * (len(positional) - len(args.defaults)) + list(args.defaults)
    out = [
        (a.arg, "POSITIONAL_ONLY" if i < len(args.posonlyargs) else "POSITIONAL_OR_KEYWORD", d)
        for i, (a, d) in enumerate(zip(positional, defaults, strict=True))
    ]
    if args.vararg:
        out.append((args.vararg.arg, "VAR_POSITIONAL", None))
    out += [
        (a.arg, "KEYWORD_ONLY", d) for a, d in zip(args.kwonlyargs, args.kw_defaults, strict=True)
    ]
    if args.kwarg:
        out.append((args.kwarg.arg, "VAR_KEYWORD", None))
    return [(n, k, None if d is None else ast.unparse(d)) for n, k, d in out]


def _actual(obj: Any) -> list[Parameter]:
    return [
        (p.name, p.kind.name, None if p.default is p.empty else repr(p.default))
        for p in inspect.signature(obj).parameters.values()
    ]


def _entries(code: str) -> list[str]:
    """The signatures of a block: each starts at column 0; comments dropped."""
    entries: list[str] = []
    for line in code.splitlines():
        text = line.split("#")[0].rstrip()
        if not text:
            continue
        if text[0].isspace() and entries:
            entries[-1] += " " + text.strip()
        else:
            entries.append(text)
    return entries


def differences(code: str) -> list[str]:
    """One line per documented signature whose parameters are not the code's."""
    problems = []
    for entry in _entries(code):
        name, args = _documented(entry)
        documented, actual = _parameters(args), _actual(_resolve(name))
        if documented != actual:
            problems.append(f"{name}\n  page: {documented}\n  code: {actual}")
    return problems
