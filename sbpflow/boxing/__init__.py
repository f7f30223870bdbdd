"""Boxing: changing a global tensor's layout (SBP and/or placement).

``plan`` builds and shows plans with no process group; ``trace`` records what
ran; ``calibrate`` measures the cost constants plans are priced with.
Executing plans is done by ``GlobalTensor.to_global``.
"""

from .calibrate import Calibration, calibrate
from .plan import BoxingPlan, BoxingStep
from .planner import plan
from .tracing import Trace, trace

__all__ = ["BoxingPlan", "BoxingStep", "Calibration", "Trace", "calibrate", "plan", "trace"]
