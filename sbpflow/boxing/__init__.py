"""Boxing: changing a global tensor's layout (SBP and/or placement).

``plan`` builds and shows plans with no process group; ``trace`` records what
ran; ``calibrate`` measures the cost constants plans are priced with, and
``load_calibration`` installs stored ones in a single process.
Executing plans is done by ``GlobalTensor.to_global``.
"""

from .calibrate import Calibration, calibrate, load_calibration
from .plan import BoxingPlan, BoxingStep
from .planner import plan
from .tracing import Trace, trace

__all__ = [
    "BoxingPlan",
    "BoxingStep",
    "Calibration",
    "Trace",
    "calibrate",
    "load_calibration",
    "plan",
    "trace",
]
