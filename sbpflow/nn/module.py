"""``Module.to_global``: convert every parameter and buffer in place.

# NOTE [a module's plain tensors are whole]
# A plain parameter or buffer is the whole logical tensor, whatever layout it is given, as
# DTensor's ``distribute_module`` reads it: every rank builds the same model, so
# ``Linear(8, 32).to_global(P, split(0))`` is the logical [32, 8] weight, each rank keeping
# its rows (rank 0's values, as for broadcast, then a local slice). Read as ``tensor.
# to_global`` reads a local tensor (each rank's tensor one shard), it would silently become a
# [64, 8] weight of the ranks' copies stacked. ``local_pieces=True`` asks for that reading, for
# a module built with only this rank's piece of each tensor. A global tensor is boxed: its
# logical value is kept. Each parameter stays the same object (NOTE [parameters keep their
# identity] in _identity).

# NOTE [shared tensors]
# A tensor registered in several places (tied input embedding and output
# projection, a shared buffer, one submodule reused under two names) is one
# tensor: it is converted once and every owner gets the same new Parameter or
# buffer, so ``named_parameters()`` deduplicates exactly as before and the
# gradients of all its uses accumulate into one ``.grad``. Its SBP is asked for
# under every name it has; names that disagree are an error, not a silent
# choice of one of them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ..placement import Placement
from ..sbp import Broadcast, normalize, sbp_str
from ..tensor import GlobalTensor, to_global
from ._identity import check_convertible, convert_in_place

SbpSpec = Any | Callable[[str, torch.Tensor], Any]


@dataclass
class _Shared:
    """One distinct tensor of a module and every (owner, attribute) that holds it."""

    tensor: torch.Tensor
    is_parameter: bool
    owners: list[tuple[torch.nn.Module, str]] = field(default_factory=list)
    names: list[str] = field(default_factory=list)


def module_to_global(
    module: torch.nn.Module, placement: Placement, sbp: SbpSpec, *, local_pieces: bool = False
) -> torch.nn.Module:
    """Convert ``module``'s parameters and buffers to global tensors, in place; returns it.

    ``sbp`` is one SBP (or N-D tuple) for all, or a callable ``(name, tensor) -> sbp``
    for per-parameter layouts (``name`` as in ``module.named_parameters()``). A plain
    tensor is the whole logical tensor, whatever its layout (rank 0's values, as for
    broadcast, each rank then keeping its piece); ``local_pieces=True`` reads each rank's
    plain tensor as its own piece instead, as ``tensor.to_global`` does (a module built
    with only this rank's shard). A global tensor is boxed (its logical value kept).
    Each parameter stays the same object, so an optimizer or hook made before keeps
    working. A tensor shared by several modules is converted once and stays shared; the
    callable must give it the same SBP under each of its names. Every rank must call
    this with the same module structure.
    """
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"expected an nn.Module, got {type(module).__name__}.")
    if not isinstance(local_pieces, bool):
        raise TypeError(
            f"local_pieces must be True or False, got {type(local_pieces).__name__}: "
            f"{local_pieces!r}."
        )
    entries = _distinct_tensors(module)
    # Every SBP is settled and every parameter checked before anything is converted: a
    # disagreement leaves the module as it was.
    layouts = [_agreed_sbp(entry, placement, sbp) for entry in entries]
    for entry in entries:
        if entry.is_parameter:
            check_convertible(entry.tensor, entry.names[0], "module.to_global")
    for entry, layout in zip(entries, layouts, strict=True):
        value = _convert(entry, entry.tensor.detach(), placement, layout, local_pieces)
        if entry.is_parameter:
            convert_in_place(entry.tensor, value, entry.names[0], "module.to_global")
            continue
        for owner, attr in entry.owners:
            owner._buffers[attr] = value
    return module


def _distinct_tensors(module: torch.nn.Module) -> list[_Shared]:
    """Every distinct parameter and buffer with all its owners, in registration order."""
    found: dict[int, _Shared] = {}
    for prefix, sub in module.named_modules(remove_duplicate=False):
        for is_parameter, table in ((True, sub._parameters), (False, sub._buffers)):
            for attr, tensor in table.items():
                if tensor is None:
                    continue
                entry = found.get(id(tensor))
                if entry is None:
                    entry = found[id(tensor)] = _Shared(tensor, is_parameter)
                elif entry.is_parameter != is_parameter:
                    param, buf = entry.names[0], _full(prefix, attr)
                    if is_parameter:
                        param, buf = buf, param
                    raise ValueError(
                        f"one tensor is registered both as a parameter ({param!r}) and as a "
                        f"buffer ({buf!r}); register it as one kind only."
                    )
                if (sub, attr) not in [(o, a) for o, a in entry.owners]:
                    entry.owners.append((sub, attr))
                entry.names.append(_full(prefix, attr))
    return list(found.values())


def _full(prefix: str, attr: str) -> str:
    return f"{prefix}.{attr}" if prefix else attr


def _agreed_sbp(entry: _Shared, placement: Placement, sbp: SbpSpec) -> Any:
    """The SBP for ``entry`` under its first name, checked against every other name."""
    if not _is_callable_spec(sbp):
        return sbp
    first = sbp(entry.names[0], entry.tensor)
    for name in entry.names[1:]:
        other = sbp(name, entry.tensor)
        if not _same_sbp(first, other, placement, entry.tensor.dim()):
            raise ValueError(
                f"{entry.names[0]!r} and {name!r} are one shared tensor (tied weights) but the sbp "
                f"callable gave them different layouts: {_show(first)} for {entry.names[0]!r} and "
                f"{_show(other)} for {name!r}. A shared tensor has one layout: return the same "
                "SBP for every name it is registered under."
            )
    return first


def _same_sbp(a: Any, b: Any, placement: Placement, ndim: int) -> bool:
    try:
        return normalize(a, placement.ndim, ndim) == normalize(b, placement.ndim, ndim)
    except (TypeError, ValueError):
        return bool(a == b)  # the conversion itself reports a malformed SBP


def _show(sbp: Any) -> str:
    try:
        return sbp_str(normalize(sbp, len(sbp) if isinstance(sbp, (tuple, list)) else 1))
    except (TypeError, ValueError):
        return repr(sbp)


def _is_callable_spec(sbp: SbpSpec) -> bool:
    return callable(sbp) and not isinstance(sbp, (tuple, list)) and not hasattr(sbp, "is_split")


def _convert(
    entry: _Shared, t: torch.Tensor, placement: Placement, sbp: Any, local_pieces: bool
) -> GlobalTensor:
    """``t`` converted (NOTE [a module's plain tensors are whole]); an error names the
    parameter or buffer (the same on every rank: every rank converts the same module's
    tensors in the same order)."""
    try:
        if isinstance(t, GlobalTensor):
            return t.to_global(placement, sbp)
        if local_pieces:
            return to_global(t, placement, sbp)
        if not isinstance(placement, Placement):
            return to_global(t, placement, sbp)  # its error names what was given
        layout = normalize(sbp, placement.ndim, t.dim())
        whole = to_global(t, placement, (Broadcast(),) * placement.ndim)
        if all(isinstance(s, Broadcast) for s in layout):
            return whole
        return whole.to_global(placement, layout, check_meta=False)
    except (ValueError, TypeError) as error:
        kind = "parameter" if entry.is_parameter else "buffer"
        raise type(error)(f"module.to_global: {kind} {entry.names[0]!r}: {error}") from error


def module_to_global_method(
    self: torch.nn.Module, placement: Placement, sbp: SbpSpec, *, local_pieces: bool = False
) -> torch.nn.Module:
    # ``torch.nn.Module.to_global`` (NOTE [what import sbpflow adds to torch] in _install).
    return module_to_global(self, placement, sbp, local_pieces=local_pieces)


module_to_global_method.__doc__ = module_to_global.__doc__
