"""Pipeline stages of a graph: the checks on what ``set_stage`` declared, and the boxing of stage inputs.

The checks are pure (metadata only, no process group). Every rank holds the
same modules with the same placements, so every rank reaches the same verdict
and raises the same error before any communication: a mistake never leaves one
rank waiting in a collective for another.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ...._global import GlobalTensor
from ....placement import Placement
from ....sbp import broadcast

__all__ = ["Stage", "box_to_stage", "check_stage_ids", "check_stages", "stage_ranks"]


@dataclass(frozen=True)
class Stage:
    """One module marked with ``config.set_stage``: its path in the graph, id and placement."""

    name: str
    module: torch.nn.Module
    stage_id: int
    placement: Placement


def check_stages(stages: Sequence[Stage]) -> None:
    """Raise ``ValueError`` for stage ids that repeat or skip, nested stages, or a tensor off its stage's placement."""
    check_stage_ids(stages)
    _check_not_nested(stages)
    for stage in stages:
        _check_placement(stage)


def stage_ranks(stages: Sequence[Stage]) -> list[int]:
    """The rank standing for each stage in a schedule, in stage-id order: its placement's first rank.

    A stage on several ranks (data parallel inside the stage) runs the same
    action list on each of them; the schedule names the first. Two different
    placements with the same first rank would be one pipeline rank running
    both, so they are an error.
    """
    ordered = sorted(stages, key=lambda s: s.stage_id)
    seen: dict[int, Stage] = {}
    for stage in ordered:
        rank = stage.placement.flat_ranks[0]
        other = seen.setdefault(rank, stage)
        if other.placement != stage.placement:
            raise ValueError(
                f"stages {other.stage_id} ({other.name!r}, on {other.placement}) and "
                f"{stage.stage_id} ({stage.name!r}, on {stage.placement}) are on different "
                f"placements that both start with rank {rank}, so a schedule cannot tell them "
                "apart; put each stage on the same placement as the stages sharing its ranks, "
                "or on ranks of its own."
            )
    return [stage.placement.flat_ranks[0] for stage in ordered]


def box_to_stage(value: Any, placement: Placement) -> Any:
    """``value`` with each global tensor in it moved onto ``placement`` (the SBP kept when it fits).

    Boxing keeps the logical value, so this changes where a stage's inputs
    live, never what they are. A tensor on a mesh of another shape arrives
    broadcast. Local tensors and other values pass unchanged.
    """
    if isinstance(value, GlobalTensor):
        if value.placement == placement:
            return value
        sbp = value.sbp if placement.shape == value.placement.shape else None
        if sbp is None:
            sbp = (broadcast,) * placement.ndim
        # The ranks agree by construction (the same program on every rank): no meta check.
        return value.to_global(placement, sbp, check_meta=False)
    if isinstance(value, tuple):
        items = [box_to_stage(v, placement) for v in value]
        return type(value)(*items) if hasattr(value, "_fields") else tuple(items)
    if isinstance(value, list):
        return [box_to_stage(v, placement) for v in value]
    if isinstance(value, dict):
        return {k: box_to_stage(v, placement) for k, v in value.items()}
    return value


def check_stage_ids(stages: Sequence[Stage]) -> None:
    """Raise ``ValueError`` unless the stage ids are 0, 1, 2, ... each set on one module."""
    by_id: dict[int, list[Stage]] = {}
    for stage in stages:
        by_id.setdefault(stage.stage_id, []).append(stage)
    for stage_id, holders in sorted(by_id.items()):
        if len(holders) > 1:
            names = ", ".join(repr(s.name) for s in holders)
            raise ValueError(
                f"stage id {stage_id} is set on {len(holders)} modules ({names}); each stage is "
                "one module: give each its own id, numbered 0, 1, 2, ... in pipeline order, or "
                "set the stage on a module containing them."
            )
    ids = sorted(by_id)
    missing = sorted(set(range(len(ids))) - set(ids)) if ids else []
    if ids and ids != list(range(len(ids))):
        declared = ", ".join(f"{s.stage_id}: {s.name!r}" for s in sorted(stages, key=_id))
        raise ValueError(
            f"stage ids must be 0..{len(ids) - 1} with none skipped, got {ids} ({declared}); "
            f"stage id(s) {missing} are missing: number the stages consecutively from 0."
        )


def _id(stage: Stage) -> int:
    return stage.stage_id


def _check_not_nested(stages: Sequence[Stage]) -> None:
    for outer in stages:
        inside = {id(m) for m in outer.module.modules() if m is not outer.module}
        for inner in stages:
            if id(inner.module) in inside:
                raise ValueError(
                    f"module {inner.name!r} (stage {inner.stage_id}) is inside module "
                    f"{outer.name!r} (stage {outer.stage_id}); stages must not nest: set the "
                    "stage on one of them only."
                )


def _check_placement(stage: Stage) -> None:
    for kind, name, tensor in _tensors(stage.module):
        where = f"{kind} {name!r} of module {stage.name!r} (stage {stage.stage_id})"
        if not isinstance(tensor, GlobalTensor):
            raise ValueError(
                f"the {where} is a local tensor, but stage {stage.stage_id} is on "
                f"{stage.placement}; convert the module first, e.g. "
                f"module.to_global({stage.placement!r}, sbpflow.sbp.broadcast)."
            )
        if tensor.placement != stage.placement:
            raise ValueError(
                f"the {where} is on {tensor.placement}, but the stage is on {stage.placement}; "
                "a stage's parameters and buffers live on its placement: convert the module "
                f"with module.to_global({stage.placement!r}, sbp) or set_stage the placement "
                "it is on."
            )


def _tensors(module: torch.nn.Module) -> Iterator[tuple[str, str, torch.Tensor]]:
    for name, param in module.named_parameters():
        yield "parameter", name, param
    for name, buffer in module.named_buffers():
        yield "buffer", name, buffer
