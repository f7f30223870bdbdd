"""The pipelined step as the layers below the pipeline runtime see it: one context variable.

# NOTE [pipeline step context]
# While the pipeline runtime (sbpflow/nn/pipeline/runtime/) runs a step, three
# things below it behave differently:
#   - ``GlobalTensor.backward`` (``loss.backward()``, ``scaler.scale(loss).backward()``)
#     in ``build`` is handed to the runtime instead of run (NOTE [deferred backward]);
#   - ``Redistribute`` shows the runtime each change of placement (NOTE [transfer
#     hook] in sbpflow/boxing/_redistribute.py);
#   - a user-level ``to_global`` skips the ranks' agreement on its metadata (NOTE
#     [no agreement in a pipelined step] in sbpflow/_meta_check.py).
# All three read ``current``: the runtime's scope for the micro-batch whose work
# runs now, or ``None`` outside a step. A context variable, not module globals
# switched per action: each micro-batch's work runs in a ``contextvars.Context``
# of its own (``Context.run`` on the runtime's thread, or the micro-batch's
# worker threads when a rank holds several stages), so the value follows the
# micro-batch, two threads never see each other's, and nothing outlives the step.
# The autograd engine would run the backward of CUDA tensors on a device thread
# of its own, where no context is set; the runtime therefore runs its backward
# passes with ``torch.autograd.set_multithreading_enabled(False)`` (the engine on
# the calling thread), so a node's backward sees the scope of the pass running it.
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch

    from ._global import GlobalTensor
    from ._layout import Layout

__all__ = ["PipelineScope", "current"]


class PipelineScope(Protocol):
    """What the runtime does for one micro-batch's work (NOTE [pipeline step context])."""

    def defer_backward(
        self,
        tensor: torch.Tensor,
        gradient: Any,
        retain_graph: bool | None,
        create_graph: bool,
        inputs: Any,
    ) -> bool:
        """Take a ``backward`` call made in ``build``; ``False`` runs it now instead."""
        ...

    def transfer_forward(self, ctx: Any, x: GlobalTensor, dst: Layout) -> None:
        """See ``x`` change placement to ``dst`` (``ctx`` is the autograd node's)."""
        ...

    def transfer_backward(self, ctx: Any, compute: Callable[[], GlobalTensor]) -> GlobalTensor:
        """The gradient of a change of placement: ``compute()`` moves it, the scope may keep it."""
        ...


current: contextvars.ContextVar[PipelineScope | None] = contextvars.ContextVar(
    "sbpflow_pipeline_scope", default=None
)
