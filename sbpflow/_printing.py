"""How global tensors print."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .sbp import sbp_str

if TYPE_CHECKING:
    from .tensor import GlobalTensor


def global_repr(t: GlobalTensor) -> str:
    grad = ", requires_grad=True" if t.requires_grad else ""
    if t.grad_fn is not None:
        grad = f", grad_fn=<{type(t.grad_fn).__name__}>"
    return (
        f"GlobalTensor(shape={list(t.shape)}, dtype={t.dtype}, placement={t.placement}, "
        f"sbp={sbp_str(t.sbp)}{grad},\n  local={t._local!r})"
    )
