"""Hooks for work run out of program order: one context variable the layers below read.

# NOTE [step hooks]
# A caller that runs the work of one program out of its order (the forward of
# one call now, its backward later, interleaved with other calls' work) installs
# ``StepHooks`` for that work, and two things below it ask them:
#   - ``GlobalTensor.backward`` (``loss.backward()``, ``scaler.scale(loss).backward()``)
#     offers the call to ``take_backward``, which may keep it to run later;
#   - ``Redistribute``, the differentiable boxing, shows ``crossing_forward``
#     each change of placement, which picks the transport of the move (NOTE
#     [transports] in sbpflow/boxing/executor.py), and hands the gradient of
#     such a crossing to ``crossing_backward``, which moves it back (NOTE
#     [crossing hooks] in sbpflow/boxing/_redistribute.py).
# Both read ``current``: the hooks of the work running now, or ``None``. A
# context variable, not module globals switched per piece of work: each piece
# runs in a ``contextvars.Context`` of its own (``Context.run``, on whatever
# thread runs it), so the value follows the work, two threads never see each
# other's, and nothing outlives the caller. The autograd engine would run the
# backward of CUDA tensors on a device thread of its own, where no context is
# set; a caller that needs the hooks in backward runs its backward passes with
# ``torch.autograd.set_multithreading_enabled(False)`` (the engine on the calling
# thread), so a node's backward sees the hooks of the pass running it.
"""

from __future__ import annotations

import contextvars
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch

    from ._global import GlobalTensor
    from ._layout import Layout
    from .boxing.executor import Transport

__all__ = ["StepHooks", "current"]


class StepHooks(Protocol):
    """What the caller does for the work run in a context (NOTE [step hooks])."""

    def take_backward(
        self,
        tensor: torch.Tensor,
        gradient: Any,
        retain_graph: bool | None,
        create_graph: bool,
        inputs: Any,
    ) -> bool:
        """Take a ``backward`` call to run later; ``False`` runs it now instead."""
        ...

    def crossing_forward(self, ctx: Any, x: GlobalTensor, dst: Layout) -> Transport | None:
        """See ``x`` change placement to ``dst`` (``ctx`` is the autograd node's); returns the
        transport of the move (``None``: the default)."""
        ...

    def crossing_backward(self, ctx: Any, grad: GlobalTensor) -> GlobalTensor:
        """The gradient of a crossing, arrived in ``grad``, moved back to ``ctx.src``."""
        ...


current: contextvars.ContextVar[StepHooks | None] = contextvars.ContextVar(
    "sbpflow_step_hooks", default=None
)
