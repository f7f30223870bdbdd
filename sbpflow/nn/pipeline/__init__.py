"""Pipeline schedules as data: per-rank action lists built by a pure function, validated,
printable and drawable like a boxing plan. No process group is involved here; the
runtime that executes a schedule builds on these types.

    >>> from sbpflow.nn.pipeline import build_schedule
    >>> print(build_schedule("1f1b", 4, [0, 1, 2, 3], 8))  # doctest: +SKIP
"""

from ._build import DEFAULT_SCHEDULE, SCHEDULE_NAMES, build_schedule
from ._validate import validate
from .actions import Action, ActionKind
from .record import Message, StepRecord
from .schedule import ActionTiming, Schedule, Simulation
from .timeline import draw_timeline

__all__ = [
    "DEFAULT_SCHEDULE",
    "SCHEDULE_NAMES",
    "Action",
    "ActionKind",
    "ActionTiming",
    "Message",
    "Schedule",
    "Simulation",
    "StepRecord",
    "build_schedule",
    "draw_timeline",
    "validate",
]
