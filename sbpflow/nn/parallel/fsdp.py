"""``fully_shard``: fully sharded data parallelism, as layouts (docs/fsdp.md).

A fully sharded module stores each parameter split on the data axis (``S(0)``, the
placement's axis 0) and computes with it broadcast there: its parameters are gathered
``S(0) -> B`` just before its forward (one flat all_gather for the module, started one
module ahead), freed after it, gathered again for its backward, and its gradients are
reduced ``P -> S(0)`` (one flat reduce_scatter for the module, overlapping the backward of
the modules before it). The optimizer then steps on the shards: parameters, gradients and
optimizer state each take 1/N of the memory. Call it on each block, then on the root, as
torch's FSDP2 ``fully_shard``. NOTEs: [fully sharded layouts] (_fsdp_param), [one gather,
one reduction per block] (_fsdp_group), [gathered parameters in autograd] and [prefetch]
(_fsdp_state).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from ..._global import GlobalTensor, meta_of, wrap
from ..._meta_check import stable_hash
from ...comm._mesh import MESHES
from ...comm._meta import same_on_every_rank
from ...comm._world import get_rank, get_world_size
from ...placement import Placement
from ...sbp import Broadcast, Partial, sbp_str
from ...tensor import to_global
from .._identity import check_convertible, convert_in_place
from ._fsdp_group import ParamGroup, ShardedState
from ._fsdp_param import DATA_AXIS, ShardedParam, shard_dim, sharded_layout
from ._fsdp_state import STATE_ATTR, FSDPState, MixedPrecision
from ._reducer import GradientSync

__all__ = ["FSDPModule", "MixedPrecisionPolicy", "ShardedState", "fully_shard"]

M = TypeVar("M", bound=torch.nn.Module)


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """The dtypes of a fully sharded module, as torch FSDP2's ``MixedPrecisionPolicy``.

    - ``param_dtype``: the gathered parameters' dtype: the module computes in it, and the
      all_gather sends it (the shards stay in their own dtype for the optimizer);
    - ``reduce_dtype``: the dtype gradients are reduced in (default: ``param_dtype``);
      the sharded ``.grad`` is in the parameter's own dtype;
    - ``output_dtype``: the module's floating outputs are cast to it (default: as computed);
    - ``cast_forward_inputs``: cast the floating inputs to ``param_dtype`` (default True).
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True


class FSDPModule:
    """What ``fully_shard`` adds to a module's class (as torch's ``FSDPModule``).

    ``isinstance(module, FSDPModule)`` says whether a module is fully sharded.
    """

    def unshard(self) -> None:
        """Gather this module's parameters now (they stay gathered until ``reshard``)."""
        _state_of(self).group.wait_unsharded()

    def reshard(self) -> None:
        """Free this module's gathered parameters."""
        _state_of(self).group.reshard()

    @property
    def sharded_state(self) -> ShardedState:
        """Where this module's parameters are: SHARDED, GATHERING or UNSHARDED."""
        return _state_of(self).group.state

    def set_requires_gradient_sync(
        self, requires_gradient_sync: bool, *, recurse: bool = True
    ) -> None:
        """Whether backward passes reduce gradients (default True). False: each module keeps
        its partial gradients, summed over backward passes, and the first backward with
        sync reduces them all (gradient accumulation with one reduction per module).
        ``recurse``: also the fully sharded modules inside this one."""
        if not isinstance(requires_gradient_sync, bool):
            raise TypeError(
                "set_requires_gradient_sync expects True or False, got "
                f"{type(requires_gradient_sync).__name__}: {requires_gradient_sync!r}."
            )
        state = _state_of(self)
        for s in state.nested_states() if recurse else [state]:
            s.group.requires_gradient_sync = requires_gradient_sync

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside the block keep their gradients unreduced; the first one
        after it reduces the sum (``set_requires_gradient_sync(False)``, then back)."""
        states = _state_of(self).nested_states()
        before = [s.group.requires_gradient_sync for s in states]
        for s in states:
            s.group.requires_gradient_sync = False
        try:
            yield
        finally:
            for s, value in zip(states, before, strict=True):
                s.group.requires_gradient_sync = value


def _state_of(module: Any) -> FSDPState:
    state = module.__dict__.get(STATE_ATTR)
    assert isinstance(state, FSDPState), "an FSDPModule without its state"
    return state


def fully_shard(
    module: M,
    placement: Placement | None = None,
    *,
    reshard_after_forward: bool = True,
    mp_policy: MixedPrecisionPolicy | None = None,
) -> M:
    """Shard ``module``'s parameters on the data axis, gathered per use (docs/fsdp.md).

    Call it on each block, then on the root. Every parameter of ``module`` that no inner
    call manages becomes a global tensor split on ``placement``'s axis 0 (the data axis),
    keeping its layout on the other axes (tensor parallelism): ``S(0)``, or the first dim
    no later axis splits. Plain parameters are taken as broadcast from the placement's
    first rank (``module.to_global(placement, broadcast)``); global ones must already be
    on ``placement`` and broadcast on the data axis. ``placement`` defaults to the global
    parameters' placement, or else to every rank (1-D).

    ``reshard_after_forward``: free the gathered parameters after the forward and gather
    them again for the backward (less memory); the root module keeps them (it runs first
    in backward). ``mp_policy``: a ``MixedPrecisionPolicy``.

    Each parameter stays the same object (NOTE [parameters keep their identity] in
    sbpflow/nn/_identity.py), so an optimizer made before or after trains the module, and
    its gradient hooks run on its sharded gradient once reduced (``.grad`` is then this
    rank's shard of the logical gradient, as the optimizer steps on it). The module's class
    becomes a subclass of ``FSDPModule``; returns ``module``. Every rank must call this
    with the same module structure; bad input raises a ``ValueError`` on every rank.
    """
    if not isinstance(module, torch.nn.Module):
        raise TypeError(
            f"fully_shard expects an nn.Module, got {type(module).__name__}: {module!r}."
        )
    if placement is not None and not isinstance(placement, Placement):
        raise TypeError(
            f"placement must be an sbpflow.placement or None, got {type(placement).__name__}: "
            f"{placement!r}. Build one with sbpflow.placement('cpu', ranks)."
        )
    if not isinstance(reshard_after_forward, bool):
        raise TypeError(
            "reshard_after_forward must be True or False, got "
            f"{type(reshard_after_forward).__name__}: {reshard_after_forward!r}."
        )
    if mp_policy is not None and not isinstance(mp_policy, MixedPrecisionPolicy):
        raise TypeError(
            "mp_policy must be an sbpflow.nn.parallel.MixedPrecisionPolicy or None, got "
            f"{type(mp_policy).__name__}: {mp_policy!r}."
        )
    return _fully_shard(module, placement, reshard_after_forward, mp_policy, None)


def _sharded_by(module: torch.nn.Module) -> tuple[Placement, frozenset[str]] | None:
    """The placement and the parameters (by their names in ``module``) that ``fully_shard``'s
    runtime on ``module`` manages; None if ``fully_shard`` was not called on it."""
    state = module.__dict__.get(STATE_ATTR)
    if not isinstance(state, FSDPState):
        return None
    return state.group.placement, frozenset(p.name for p in state.group.params)


def _fully_shard(
    module: M,
    placement: Placement | None,
    reshard_after_forward: bool,
    mp_policy: MixedPrecisionPolicy | None,
    dims: dict[str, int] | None,
) -> M:
    """``fully_shard`` with its arguments checked. ``dims`` (None: every parameter, each on
    ``shard_dim``'s dim) names the parameters to shard, by their names in ``module``, with
    the dim each is split on: the others stay as they are (an auto_parallel plan's fully
    sharded modules, NOTE [fully sharded modules of a plan] in sbpflow/auto_parallel/_api.py)."""
    if STATE_ATTR in module.__dict__:
        raise ValueError(
            f"fully_shard was already called on this {_original_class(module).__name__}; call "
            "it once "
            "per module (each block, then the root)."
        )
    entries = _unmanaged_params(module)
    if dims is not None:
        entries = [e for e in entries if e.name in dims]
    placement = _resolve_placement(placement, entries)
    _check(entries, placement)
    for entry in entries:
        check_convertible(entry.tensor, entry.name, "fully_shard")
        _leave_data_parallel_sync(entry)
    rank = get_rank()
    MESHES.of(placement, "fully_shard")
    _agree(entries, placement)
    precision = _resolve_precision(mp_policy, entries)
    params = []
    for entry in entries:
        sharded = _shard(entry, placement, None if dims is None else dims[entry.name])
        if sharded is None:
            continue
        param, dim = sharded
        compute = precision.param_dtype or param.dtype
        params.append(ShardedParam(entry.name, param, entry.owners, dim, compute, rank))
    orig = params[0].param.dtype if params else torch.get_default_dtype()
    compute_dtype = precision.param_dtype or orig
    reduce_dtype = precision.reduce_dtype or compute_dtype
    group = ParamGroup(params, placement, rank, compute_dtype, reduce_dtype)
    module.__dict__[STATE_ATTR] = FSDPState(module, group, reshard_after_forward, precision)
    module.__class__ = _fsdp_class(type(module))
    return module


# -- what the call manages ------------------------------------------------------------


@dataclass
class _Entry:
    """One distinct parameter of the module and every (owner, attribute) holding it."""

    name: str
    tensor: torch.Tensor
    owners: list[tuple[torch.nn.Module, str]]


def _unmanaged_params(module: torch.nn.Module) -> list[_Entry]:
    """The module's distinct parameters that no inner ``fully_shard`` manages, in order."""
    managed: set[int] = set()
    for sub in module.modules():
        state = sub.__dict__.get(STATE_ATTR)
        if isinstance(state, FSDPState):
            managed.update(id(p.param) for p in state.group.params)
    found: dict[int, _Entry] = {}
    for prefix, sub in module.named_modules(remove_duplicate=False):
        for attr, tensor in sub._parameters.items():
            if tensor is None or id(tensor) in managed:
                continue
            entry = found.get(id(tensor))
            if entry is None:
                name = f"{prefix}.{attr}" if prefix else attr
                entry = found[id(tensor)] = _Entry(name, tensor, [])
            if (sub, attr) not in entry.owners:
                entry.owners.append((sub, attr))
    return list(found.values())


def _resolve_placement(placement: Placement | None, entries: list[_Entry]) -> Placement:
    if placement is not None:
        world = get_world_size()
        outside = [r for r in placement.flat_ranks if r >= world]
        if outside:
            raise ValueError(
                f"fully_shard: the placement {placement} names ranks {outside} but the world "
                f"has {world} ranks (0 to {world - 1}); give a placement of existing ranks."
            )
        return placement
    placements = {e.tensor.placement for e in entries if isinstance(e.tensor, GlobalTensor)}
    if len(placements) == 1:
        return placements.pop()
    if len(placements) > 1:
        raise ValueError(
            f"fully_shard: the module's parameters are on several placements "
            f"({sorted(map(str, placements))}); pass placement= for the one to shard on, with "
            "every parameter on it."
        )
    device = next((e.tensor.device.type for e in entries), "cpu")
    return Placement(device, list(range(get_world_size())))


def _check(entries: list[_Entry], placement: Placement) -> None:
    """The same ValueError on every rank for a module fully_shard cannot take (every rank
    sees the same metadata, so no communication is needed to agree on it)."""
    world = get_world_size()
    plain = [e.name for e in entries if not isinstance(e.tensor, GlobalTensor)]
    if plain and placement.num_ranks != world:
        missing = sorted(set(range(world)) - set(placement.flat_ranks))
        raise ValueError(
            f"fully_shard: the placement {placement} does not hold ranks {missing}, but the "
            f"module's parameters {plain[:3]} are plain tensors, which fully_shard converts on "
            "every rank. Give a placement of every rank, or, for a pipeline stage on some "
            "ranks, convert the stage first (stage.to_global(placement, "
            "sbpflow.sbp.broadcast)) and then call fully_shard(stage, placement) on every rank."
        )
    for e in entries:
        t = e.tensor
        if not isinstance(t, GlobalTensor):
            continue
        if t.placement != placement:
            raise ValueError(
                f"fully_shard: parameter {e.name!r} is on {t.placement}, but the module is "
                f"sharded on {placement}; put every parameter on that placement first "
                "(module.to_global(placement, sbp)), or pass its placement."
            )
        data = t.sbp[DATA_AXIS]
        if not isinstance(data, Broadcast) or any(isinstance(s, Partial) for s in t.sbp):
            want = list(t.sbp)
            want[DATA_AXIS] = Broadcast()
            raise ValueError(
                f"fully_shard: parameter {e.name!r} is already global with layout "
                f"{sbp_str(t.sbp)}; fully_shard shards parameters that are broadcast on the "
                f"placement's axis 0 (the data axis) and split or broadcast on the others, "
                f"e.g. {sbp_str(tuple(want))}. Convert it first (to_global), or leave the "
                "module out."
            )
    dtypes = {e.tensor.dtype for e in entries if e.tensor.requires_grad}
    if len(dtypes) > 1:
        raise ValueError(
            f"fully_shard: the module's trainable parameters have several dtypes "
            f"({sorted(map(str, dtypes))}); one call gathers and reduces them as one buffer, "
            "so they need one dtype. Cast them (module.to(dtype)) or shard the submodules of "
            "each dtype in separate calls."
        )


def _agree(entries: list[_Entry], placement: Placement) -> None:
    """Every rank must shard the same parameters (names, shapes, dtypes) on one placement."""
    text = repr(
        (str(placement), [(e.name, tuple(e.tensor.shape), str(e.tensor.dtype)) for e in entries])
    )
    if not same_on_every_rank(stable_hash(text) & (2**62 - 1)):
        names = [e.name for e in entries][:4]
        raise ValueError(
            f"fully_shard: the ranks passed different modules (this rank's parameters begin "
            f"{names}, on {placement}); every rank must call fully_shard with the same "
            "module structure, in the same order."
        )


def _resolve_precision(
    policy: MixedPrecisionPolicy | None, entries: list[_Entry]
) -> MixedPrecision:
    policy = policy or MixedPrecisionPolicy()
    for what in ("param_dtype", "reduce_dtype", "output_dtype"):
        value = getattr(policy, what)
        if value is not None and not (isinstance(value, torch.dtype) and value.is_floating_point):
            raise ValueError(
                f"MixedPrecisionPolicy.{what} must be a floating torch.dtype or None, got "
                f"{value!r}; e.g. {what}=torch.bfloat16."
            )
    return MixedPrecision(
        policy.param_dtype, policy.reduce_dtype, policy.output_dtype, policy.cast_forward_inputs
    )


def _shard(
    entry: _Entry, placement: Placement, dim: int | None = None
) -> tuple[GlobalTensor, int] | None:
    """Make ``entry`` a global parameter split on the data axis (on ``dim``, or else
    ``shard_dim``'s); None where it cannot be (NOTE [fully sharded layouts]: it stays
    broadcast, data parallel)."""
    t = entry.tensor
    requires_grad = t.requires_grad
    if not isinstance(t, GlobalTensor):
        t = to_global(t.detach(), placement, (Broadcast(),) * placement.ndim)
    layout = t._layout
    if dim is None:
        dim = shard_dim(layout, t.ndim)
    if dim is None or placement.shape[DATA_AXIS] == 1:
        _replace(entry, t)
        return None
    target = sharded_layout(layout, dim)
    with torch.no_grad():
        boxed = to_global(t.detach(), placement, target.sbp, check_meta=False)
    # the slice of a broadcast piece is a view of it: a copy of its own frees the rest
    local = boxed._local.clone(memory_format=torch.contiguous_format)
    _replace(entry, wrap(local, meta_of(target, tuple(t.shape), t.dtype)))
    param = entry.tensor
    assert isinstance(param, GlobalTensor) and param.requires_grad == requires_grad
    return param, dim


def _replace(entry: _Entry, value: GlobalTensor) -> None:
    """The parameter takes ``value`` and stays the same object (NOTE [parameters keep their
    identity] in sbpflow/nn/_identity.py)."""
    convert_in_place(entry.tensor, value, entry.name, "fully_shard")


def _leave_data_parallel_sync(entry: _Entry) -> None:
    """A parameter that trained data parallel leaves its bucketed gradient sync: fully_shard
    reduces its gradients from now on (the default sync's other parameters go back to the
    per-parameter path and join buckets again in their next backward pass)."""
    sync = GradientSync.of(entry.tensor)
    if sync is None:
        return
    if sync.explicit:
        raise ValueError(
            f"fully_shard: parameter {entry.name!r} has its gradients reduced by "
            "sync_gradients(...), and fully_shard reduces them itself. Call sync.remove() "
            "first, or leave the module out of fully_shard."
        )
    sync.remove()


_classes: dict[type, type] = {}


def _original_class(module: torch.nn.Module) -> type:
    """The module's class before ``fully_shard`` mixed ``FSDPModule`` in."""
    cls = type(module)
    return cls.__mro__[2] if issubclass(cls, FSDPModule) else cls


def _fsdp_class(cls: type) -> type:
    """``cls`` with ``FSDPModule`` mixed in (one class per original class)."""
    if issubclass(cls, FSDPModule):
        return cls
    made = _classes.get(cls)
    if made is None:
        made = _classes[cls] = type(f"FSDP{cls.__name__}", (FSDPModule, cls), {})
    return made
