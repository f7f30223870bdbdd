"""Auto-parallel: choose every layout of a training step by a cost search over the whole step.

``sbpflow.auto_parallel(model, placement, example_inputs)`` captures the step on meta
tensors (no data, no process group), prices every op's candidate strategies and the boxing
between them, and solves for the cheapest whole-step choice under an optional memory budget.
It returns a ``Plan``: pure data, the same on every rank and machine. ``plan.apply(model)``
converts the parameters to the planned layouts and hooks the module boundaries so the step
boxes where the plan says. See docs/auto-parallel.md.
"""

from ._api import auto_parallel, reprice
from ._calibrate import calibrate_compute
from ._costs import ComputeModel
from ._follow import unfollow
from ._plan import Boundary, Collective, Memory, OpChoice, ParamLayout, Plan, ShardedModule

__all__ = [
    "Boundary",
    "Collective",
    "ComputeModel",
    "Memory",
    "OpChoice",
    "ParamLayout",
    "Plan",
    "ShardedModule",
    "auto_parallel",
    "calibrate_compute",
    "reprice",
    "unfollow",
]
