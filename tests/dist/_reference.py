"""Single-process references for the boxing tests: logical tensors and the pieces ranks hold.

Everything here is computed independently of sbpflow's layout code:
``torch.tensor_split`` cuts by the balanced rule, and partial inputs are
integer-valued parts that sum exactly to the logical tensor.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

import sbpflow
from sbpflow.sbp import Broadcast, Partial, SbpParallel, Split

S0, S1, B, P = Split(0), Split(1), Broadcast(), Partial("sum")
SBPS: tuple[SbpParallel, ...] = (S0, S1, B, P)
SHAPES: tuple[tuple[int, int], ...] = ((8, 12), (13, 5), (3, 7), (0, 4))


def logical(shape: Sequence[int], seed: int) -> torch.Tensor:
    """A logical tensor of small integers (float32), the same on every rank for a seed."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(-8, 9, tuple(shape), generator=gen).to(torch.float32)


def partial_parts(value: torch.Tensor, num_parts: int, seed: int) -> list[torch.Tensor]:
    """``num_parts`` integer-valued tensors that sum exactly to ``value``."""
    gen = torch.Generator().manual_seed(seed + 7919)
    parts = [
        torch.randint(-5, 6, value.shape, generator=gen).to(value.dtype)
        for _ in range(num_parts - 1)
    ]
    parts.append(value - sum(parts, torch.zeros_like(value)))
    return parts


def piece(value: torch.Tensor, ranks: Sequence[int], sbp: SbpParallel, rank: int) -> torch.Tensor:
    """The region of ``value`` that ``rank`` covers under a 1-D ``sbp`` (whole for B and P)."""
    if isinstance(sbp, Split) and len(ranks) > 1:
        return torch.tensor_split(value, len(ranks), dim=sbp.dim)[list(ranks).index(rank)]
    return value


def source_local(
    value: torch.Tensor, ranks: Sequence[int], sbp: SbpParallel, rank: int, seed: int
) -> torch.Tensor:
    """What ``rank`` passes to ``to_global(placement(ranks), sbp)`` to build ``value``."""
    if rank not in ranks:
        return value.clone()  # a rank outside passes a tensor shaped like the others'
    if isinstance(sbp, Partial) and len(ranks) > 1:
        return partial_parts(value, len(ranks), seed)[list(ranks).index(rank)]
    return piece(value, ranks, sbp, rank).clone()


def placement(ranks: Sequence[int]) -> sbpflow.Placement:
    return sbpflow.placement("cpu", list(ranks))


def case_name(case: Sequence[Any]) -> str:
    src_ranks, dst_ranks, shape, src, dst = case[:5]
    return f"{src}->{dst} {list(src_ranks)}->{list(dst_ranks)} shape {list(shape)}"
