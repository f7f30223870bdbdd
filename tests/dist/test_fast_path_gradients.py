"""A repeated call takes the dispatch fast path (NOTE [fast path] in sbpflow/_dispatch.py) and
must hook exactly the inputs the full path hooks, also when a list of numbers comes before
them in the op's arguments (``layer_norm(x, [H, W], w, b)``): the gradients of the second
call equal the first's and one process's.

2 gloo ranks; the batch split, the weight and bias broadcast and computed from parameters
(non-leaf, so the decision's fan-out hooks apply to them).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import sbpflow
from sbpflow.sbp import Broadcast, Split
from sbpflow.testing import get_pool

B, S0 = Broadcast(), Split(0)


def _grads(normalized: list[int], on_ranks: bool) -> list[list[torch.Tensor]]:
    """The gradients of x, w and b after each of two identical layer_norm calls."""
    torch.manual_seed(0)
    x0 = torch.randn(4, 3, 2, 5)
    w0, b0 = torch.randn(*normalized), torch.randn(*normalized)
    placement = sbpflow.placement("cpu", [0, 1]) if on_ranks else None
    x = x0.to_global(placement, B).to_global(placement, S0).detach() if on_ranks else x0.clone()
    w = w0.to_global(placement, B) if on_ranks else w0.clone()
    b = b0.to_global(placement, B) if on_ranks else b0.clone()
    for t in (x, w, b):
        t.requires_grad_()
    out = []
    for _ in range(2):
        y = F.layer_norm(x, normalized, w * 2.0, b * 2.0)  # non-leaf weight and bias
        (y * y).sum().backward()
        grads = [t.grad for t in (x, w, b)]
        if on_ranks:
            grads = [g.to_global(placement, B).to_local() for g in grads]
        out.append([g.clone() for g in grads])
        for t in (x, w, b):
            t.grad = None
    return out


def _job(normalized: list[int]) -> list[list[torch.Tensor]]:
    return _grads(normalized, on_ranks=True)


@pytest.mark.parametrize("normalized", [[5], [2, 5], [3, 2, 5]])
def test_second_call_hooks_what_the_first_hooks(normalized: list[int]) -> None:
    want = _grads(normalized, on_ranks=False)
    for rank, got in enumerate(get_pool(2).run(_job, normalized)):
        for call in range(2):
            for name, g, w in zip("xwb", got[call], want[call], strict=True):
                assert torch.allclose(g, w, atol=1e-5), (rank, call, name, (g - w).abs().max())
