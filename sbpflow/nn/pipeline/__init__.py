"""Pipelines: ``Graph`` (OneFlow's training-step API), schedules as data, and the runtime.

``schedules/`` is pure: per-rank action lists built by a pure function,
validated, printable and drawable like a boxing plan, with no process group.
``runtime/`` runs a schedule on this rank, each rank computing only the stages
it holds. ``graph.py`` is the user's entry point; ``sbpflow.nn`` re-exports
``Graph``, ``GraphConfig``, ``Block`` and ``BlockConfig``.

    >>> from sbpflow.nn.pipeline import build_schedule
    >>> print(build_schedule("1f1b", 4, [0, 1, 2, 3], 8))  # doctest: +SKIP
"""

from ._block import Block, BlockConfig
from .graph import Graph, GraphConfig
from .runtime import current_action
from .schedules import (
    DEFAULT_SCHEDULE,
    SCHEDULE_NAMES,
    Action,
    ActionKind,
    ActionTiming,
    Message,
    Schedule,
    Simulation,
    StepRecord,
    build_schedule,
    draw_timeline,
    validate,
)

__all__ = [
    "DEFAULT_SCHEDULE",
    "SCHEDULE_NAMES",
    "Action",
    "ActionKind",
    "ActionTiming",
    "Block",
    "BlockConfig",
    "Graph",
    "GraphConfig",
    "Message",
    "Schedule",
    "Simulation",
    "StepRecord",
    "build_schedule",
    "current_action",
    "draw_timeline",
    "validate",
]
