"""Pipeline schedules as data (pure: no process group, no tensors).

Per-rank action lists built by a pure function, validated, printable and
drawable like a boxing plan; ``StepRecord`` is what a runtime reports it ran,
in the same terms.

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
