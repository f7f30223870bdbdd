"""Data parallelism with nothing to call: a global model's gradients join buckets by themselves.

# NOTE [data parallel by default]
# A global parameter broadcast on a data axis (B over more than one rank)
# whose gradient arrives partial there is data parallel, and its gradients
# are reduced in buckets that overlap backward (NOTE [bucketed gradient sync]
# in ``_reducer``) without any call:
#   1. In its first backward pass the leaf's own gradient hook
#      (``keep_grad_layout`` in ``_global``) leaves its gradient partial
#      (``Discovery.holds``) and, after AccumulateGrad, ``Discovery.sees`` notes
#      it, in the order the gradients became ready.
#   2. At the end of that backward pass (``queue_callback``) the parameters
#      noted join one ``GradientSync``, in that order: the order backward
#      produces them, as torch DDP rebuilds its buckets after its first
#      iteration. Buckets of torch DDP's default sizes (25 MB, the first 1 MiB).
#      The partial gradients accumulated in that pass are reduced in those
#      buckets at once (``GradientSync.reduce_accumulated``), before
#      ``backward()`` returns.
#   3. From the next backward pass on their gradients are reduced in those
#      buckets as backward runs: launched as each fills, waited for at the end of
#      backward, so ``.grad`` is reduced before anything can read it
#      (``clip_grad_norm_``, ``optimizer.step()``).
# Every rank of a data-parallel group runs the same program and so notes the
# same parameters in the same order; step 2 checks it (one all_reduce of a
# hash per group, once) and raises on every rank of the group if not, since
# their bucket all_reduces would pair up wrongly. Parameters that first get a
# gradient later (unused so far) join later, in buckets of their own.
# ``nn.Parameter``s join in their first backward pass; another leaf (a bare
# ``requires_grad`` global tensor) in its second (its first is boxed per
# leaf), so a tensor made anew each step stays on the per-parameter path
# instead of paying a check and a buffer each step. The passes a bare leaf was
# seen in are counted in the ``Discovery``'s own ``Sightings``, not on the
# tensor (a copy of the leaf is a new leaf, seen in none).
# ``torch.autograd.grad`` and ``backward(create_graph=True)`` stay on the
# per-parameter path.
# The core knows none of this: ``import sbpflow`` binds one ``Discovery`` to the
# layout hooks' handler of partial gradients (``bind_partial_gradients``, in
# ``sbpflow._install``, NOTE [what import sbpflow adds to torch]); importing this
# package binds nothing.
# ``sync_gradients(module, bucket_cap_mb=...)`` replaces the default buckets
# of the module's parameters by its own (fixed from the registration order
# before any backward, with its cap), and ``no_sync(module)`` holds them for
# gradient accumulation.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..._global import GlobalTensor, PartialGradients, _pre_hooks
from ..._meta_check import stable_hash
from ...comm import collectives
from ...comm._mesh import MESHES
from ...comm._world import get_rank
from ...sbp import sbp_str
from ._params import NO_SYNC, GlobalParam, data_axes
from ._reducer import GradientSync, accumulating

__all__ = ["Discovery", "Sightings"]


class Sightings:
    """How many backward passes each bare leaf's gradient arrived partial on a data axis in.

    Kept by leaf ``id``, each record checked against the leaf's own gradient-hook dict, held
    weakly (the leaf itself is never referenced: ``torch.utils.swap_tensors`` refuses a tensor
    with weakrefs, and a strong reference would keep every leaf alive). That dict is made
    for the leaf by its layout hooks and lives as long as it: a new tensor that takes a freed
    leaf's ``id`` has another one, and counts from zero; the record goes when the dict does.
    """

    def __init__(self) -> None:
        self._by_leaf: dict[int, tuple[weakref.ref[Any], int]] = {}

    def count(self, leaf: GlobalTensor) -> int:
        found = self._by_leaf.get(id(leaf))
        if found is None or found[0]() is not _hooks_of(leaf):
            return 0
        return found[1]

    def add(self, leaf: GlobalTensor) -> int:
        """Note one more backward pass; returns the new count."""
        hooks = _hooks_of(leaf)
        if hooks is None:  # no hook dict of its own: nothing to check a record against
            return 0
        seen = self.count(leaf) + 1
        key = id(leaf)
        self._by_leaf[key] = (weakref.ref(hooks, functools.partial(self._drop, key)), seen)
        return seen

    def _drop(self, key: int, ref: weakref.ref[Any]) -> None:
        found = self._by_leaf.get(key)
        if found is not None and found[0] is ref:
            del self._by_leaf[key]

    def __len__(self) -> int:
        return len(self._by_leaf)


def _hooks_of(leaf: GlobalTensor) -> Any:
    """The gradient-hook dict made for ``leaf`` (None if it has none)."""
    hooks = _pre_hooks(leaf)
    return hooks if type(hooks) is not dict else None  # ``{}``: none was made


class Discovery(PartialGradients):
    """The parameters noted in the running backward pass, joined into buckets at its end.

    The layout hooks of a leaf (``keep_grad_layout``) show it here when its gradient arrives
    partial on a data axis (NOTE [partial gradients of leaves] in ``_global``): it is left
    partial inside a ``no_sync()`` block that holds it, and noted after AccumulateGrad.
    """

    def __init__(self) -> None:
        self._noted: list[GlobalTensor] = []
        self.sightings = Sightings()  # bare leaves: the passes they were seen in
        self._held = False  # a noted gradient was left partial: reduce them at the end
        self._callback: Callable[[], Any] | None = None  # the end-of-backward one, weakly

    def holds(self, leaf: GlobalTensor) -> bool:
        """Inside a ``no_sync()`` block, or joining buckets at the end of this backward pass
        (which reduce its gradient then)."""
        return NO_SYNC.holds(leaf) or self._joins(leaf)

    def _joins(self, leaf: GlobalTensor) -> bool:
        """Whether ``sees`` will note ``leaf`` in this backward pass (asked before it does)."""
        if not data_axes(leaf._layout) or not accumulating():
            return False
        return isinstance(leaf, torch.nn.Parameter) or self.sightings.count(leaf) >= 1

    def sees(self, leaf: GlobalTensor) -> None:
        """After AccumulateGrad of a leaf whose gradient arrived partial on a data axis."""
        if GradientSync.of(leaf) is not None or not data_axes(leaf._layout):
            return
        if not isinstance(leaf, torch.nn.Parameter) and self.sightings.add(leaf) < 2:
            return
        if self._callback is None or self._callback() is None:
            # none queued in this backward pass (or the one that queued it raised)
            self._noted, self._held = [], False
            join = functools.partial(self._join)
            torch.autograd.Variable._execution_engine.queue_callback(join)
            self._callback = weakref.ref(join)
        self._noted.append(leaf)
        self._held = self._held or self._joins(leaf)

    def _join(self) -> None:
        noted, held = self._noted, self._held
        self._noted, self._held, self._callback = [], False, None
        members, seen = [], set()
        for leaf in noted:
            if (
                id(leaf) in seen
                or GradientSync.of(leaf) is not None
                or not leaf.requires_grad
                or not data_axes(leaf._layout)
            ):
                continue
            seen.add(id(leaf))
            description = _describe(leaf)
            members.append(GlobalParam(description, leaf, description))
        if members:
            _check_same_order(members)
            sync = GradientSync(members, None, explicit=False)
            if held:  # not when create_graph kept each .grad boxed, with its history
                sync.reduce_accumulated()


def _describe(leaf: GlobalTensor) -> str:
    return f"a {tuple(leaf.shape)} {str(leaf.dtype).removeprefix('torch.')} parameter ({sbp_str(leaf.sbp)})"


def _check_same_order(members: Sequence[GlobalParam]) -> None:
    """Raise on every rank of a data-parallel group whose ranks noted other parameters, or
    another order (NOTE [data parallel by default])."""
    rank = get_rank()
    groups: dict[Any, list[GlobalParam]] = {}
    for m in members:
        groups.setdefault((m.layout.placement, m.data_axes), []).append(m)
    for (placement, axes), mine in groups.items():
        if rank not in placement:
            continue
        lines = MESHES.of(placement, "gradient buckets").lines(axes)
        assert lines  # rank is in the placement
        ranks = next(g for g in placement.groups_along(axes) if rank in g)
        if len(ranks) == 1:
            continue
        value = stable_hash(repr([(tuple(m.param.shape), m.param.dtype) for m in mine]))
        if not _same_along(value, [group for _, group in lines], mine[0].local.device):
            raise RuntimeError(
                f"sbpflow: the data-parallel ranks {list(ranks)} computed the gradients of "
                "different parameters, or in a different order, in this backward pass, so their "
                "bucketed reductions would not pair up. Every rank must run the same program "
                "on its own slice of the batch; this rank's were "
                f"{', '.join(m.label for m in mine[:4])}{', ...' if len(mine) > 4 else ''}."
            )


def _same_along(value: int, lines: Sequence[collectives.Group], device: torch.device) -> bool:
    """``collectives.same_in_group`` over the groups ``lines`` reduce along one after another
    (``Mesh.lines``): the largest value and minus the smallest, carried from one to the next."""
    if len(lines) == 1:
        return collectives.same_in_group(value, lines[0], device)
    pair = torch.tensor([value, -value], dtype=torch.int64, device=device)
    for group in lines:
        pair = collectives.all_reduce(pair, group, "max", inplace=True)
    largest, minus_smallest = pair.tolist()
    return largest == -minus_smallest
