"""One fully sharded parameter: its two layouts and its place in a block's flat collectives.

# NOTE [fully sharded layouts]
# A fully sharded module computes with each parameter broadcast on the data axis (the
# placement's axis 0) and stores it split there:
#   unsharded  U = the parameter's layout with B on the data axis; its layouts on the
#                  other axes (tensor parallelism) are kept;
#   sharded    S = U with S(d) on the data axis.
# d is the first tensor dim that no axis after the data axis splits (usually 0). Axes
# split the logical tensor in order (NOTE [balanced split] in _layout), so the data axis
# then cuts this rank's piece of U into balanced pieces along d, one per member of its
# data group, and gathering them in mesh order along d gives U's piece back: one
# all_gather, nothing to reorder across other axes. A 0-d parameter, or one whose every
# dim a later axis splits (the bias of a column-parallel Linear on a (data, tensor)
# mesh), cannot be cut so; it stays broadcast on the data axis and is trained data
# parallel (its partial gradient all-reduced), as a parameter of no fully sharded module.
#
# In a block's flat collectives (NOTE [flat collectives] in comm/collectives.py) each
# member's row holds, for each parameter in order, its piece padded to the longest
# piece along d (balanced pieces differ by at most one slice), and after the parameters
# one flag per parameter (``ParamGroup``). ``ShardGeometry`` is that arithmetic, pure;
# ``ShardedParam`` moves one parameter's data in and out of the rows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..._global import GlobalTensor, Meta, meta_of, wrap
from ..._layout import Layout, balanced_sizes
from ...sbp import Broadcast, Split

__all__ = ["DATA_AXIS", "ShardGeometry", "ShardedParam", "shard_dim", "sharded_layout"]

DATA_AXIS = 0  # the placement axis a fully sharded module shards its parameters over


def shard_dim(layout: Layout, ndim: int) -> int | None:
    """The tensor dim to split on the data axis (NOTE [fully sharded layouts]); None: none."""
    later = {s.dim for s in layout.sbp[DATA_AXIS + 1 :] if isinstance(s, Split)}
    return next((d for d in range(ndim) if d not in later), None)


def sharded_layout(unsharded: Layout, dim: int) -> Layout:
    """``unsharded`` with ``S(dim)`` on the data axis."""
    sbp = list(unsharded.sbp)
    sbp[DATA_AXIS] = Split(dim)
    return Layout(unsharded.placement, tuple(sbp))


def unsharded_layout(sharded: Layout) -> Layout:
    """``sharded`` with ``B`` on the data axis."""
    sbp = list(sharded.sbp)
    sbp[DATA_AXIS] = Broadcast()
    return Layout(sharded.placement, tuple(sbp))


@dataclass(frozen=True)
class ShardGeometry:
    """Where one parameter's pieces sit, on one rank of its data group (pure arithmetic).

    ``local_shape`` is this rank's piece of the unsharded layout; along ``dim`` the data
    group's members hold ``sizes`` (mesh order) starting at ``starts``; every member's
    padded piece is ``padded_shape`` (``padded_numel`` elements) in its row.
    """

    dim: int
    local_shape: tuple[int, ...]
    sizes: tuple[int, ...]
    member: int  # this rank's index in its data group (mesh order)

    @classmethod
    def of(cls, shape: tuple[int, ...], unsharded: Layout, dim: int, rank: int) -> ShardGeometry:
        local_shape = unsharded.local_shape(shape, rank)
        num = unsharded.placement.shape[DATA_AXIS]
        member = unsharded.placement.coords_of(rank)[DATA_AXIS]
        return cls(dim, local_shape, tuple(balanced_sizes(local_shape[dim], num)), member)

    @property
    def starts(self) -> tuple[int, ...]:
        out, at = [], 0
        for size in self.sizes:
            out.append(at)
            at += size
        return tuple(out)

    @property
    def padded_shape(self) -> tuple[int, ...]:
        shape = list(self.local_shape)
        shape[self.dim] = max(self.sizes)
        return tuple(shape)

    @property
    def padded_numel(self) -> int:
        return math.prod(self.padded_shape)

    @property
    def even_rows(self) -> bool:
        """Whether the members' rows, stacked, are the unsharded piece (split on dim 0,
        no padding): then one copy moves all of them."""
        return self.dim == 0 and len(set(self.sizes)) == 1


class ShardedParam:
    """A parameter of a fully sharded module: stored sharded, computed with unsharded.

    ``param`` is the ``nn.Parameter`` the module and the optimizer hold (sharded layout);
    ``owners`` the (module, attribute) pairs that hold it; ``unsharded`` this rank's
    piece of the gathered parameter, a view into its group's buffer (set by ``ParamGroup``;
    an empty tensor on a rank outside the placement, which has no ``geometry``).
    """

    def __init__(
        self,
        name: str,
        param: GlobalTensor,
        owners: list[tuple[torch.nn.Module, str]],
        dim: int,
        compute_dtype: torch.dtype,
        rank: int,
    ) -> None:
        self.name, self.param, self.owners = name, param, owners
        shape = tuple(param.shape)
        layout = unsharded_layout(param._layout)
        self.unsharded_meta: Meta = meta_of(layout, shape, compute_dtype)
        self.geometry = (
            ShardGeometry.of(shape, layout, dim, rank) if rank in layout.placement else None
        )
        self.offset = 0  # of its padded piece in a member's row (set by ParamGroup)
        self.unsharded: torch.Tensor = param._local.new_empty(
            layout.local_shape(shape, rank), dtype=compute_dtype
        )

    @property
    def requires_grad(self) -> bool:
        return self.param.requires_grad

    @property
    def padded_numel(self) -> int:
        return 0 if self.geometry is None else self.geometry.padded_numel

    def gathered(self) -> GlobalTensor:
        """A new tensor of the unsharded parameter (it becomes an output of the autograd
        node of the block's gather, NOTE [gathered parameters in autograd] in _fsdp_state)."""
        return wrap(self.unsharded, self.unsharded_meta)

    def _geometry(self) -> ShardGeometry:
        assert self.geometry is not None, "a rank outside the placement moves no data"
        return self.geometry

    def _in_row(self, row: torch.Tensor) -> torch.Tensor:
        """Its padded piece in ``row`` (one member's row of a flat buffer)."""
        g = self._geometry()
        return row[self.offset : self.offset + g.padded_numel].view(g.padded_shape)

    def _column(self, rows: torch.Tensor) -> torch.Tensor:
        """Its padded pieces in every row: (members, padded_numel)."""
        return rows[:, self.offset : self.offset + self._geometry().padded_numel]

    def _stacked(self, slots: list[int]) -> bool:
        """Whether the rows, in order, stacked are the unsharded piece (one copy moves all)."""
        return self._geometry().even_rows and slots == sorted(slots)

    def copy_in(self, row: torch.Tensor) -> None:
        """Put this rank's shard into its place in this rank's row of the gather."""
        g = self._geometry()
        self._in_row(row).narrow(g.dim, 0, g.sizes[g.member]).copy_(self.param._local)

    def copy_out(self, rows: torch.Tensor, slots: list[int]) -> None:
        """Fill ``unsharded`` from the gathered ``rows`` (one per member, process-group order)."""
        g = self._geometry()
        if self._stacked(slots):
            self.unsharded.view(len(slots), -1).copy_(self._column(rows))
            return
        for k, (start, size) in enumerate(zip(g.starts, g.sizes, strict=True)):
            piece = self._in_row(rows[slots[k]]).narrow(g.dim, 0, size)
            self.unsharded.narrow(g.dim, start, size).copy_(piece)

    def grad_into_rows(
        self, grad: torch.Tensor, rows: torch.Tensor, slots: list[int], add: bool
    ) -> None:
        """Put (``add``: add) this rank's partial gradient ``grad`` (shaped as ``unsharded``)
        into the reduce_scatter rows: member ``k``'s part into row ``slots[k]``."""
        g = self._geometry()
        if self._stacked(slots):
            column = self._column(rows)
            source = grad.reshape(column.shape)
            column.add_(source) if add else column.copy_(source)
            return
        for k, (start, size) in enumerate(zip(g.starts, g.sizes, strict=True)):
            dst = self._in_row(rows[slots[k]]).narrow(g.dim, 0, size)
            src = grad.narrow(g.dim, start, size)
            dst.add_(src) if add else dst.copy_(src)

    def zero_rows(self, rows: torch.Tensor) -> None:
        """Zeros for its part of every row (no gradient on this rank)."""
        self._column(rows).zero_()

    def shard_of(self, row: torch.Tensor) -> torch.Tensor:
        """This rank's shard, read from its row of a reduce_scatter's result."""
        g = self._geometry()
        return self._in_row(row).narrow(g.dim, 0, g.sizes[g.member])
