"""GPU tier: torch's optimizers and clip_grad_norm_ take foreach by default on global CUDA
parameters, and each ``_foreach_*`` call is one dispatch; compared with the same model as
plain CUDA tensors in this process.

Skipped when CUDA is absent. A cuda placement of one rank (NCCL refuses two ranks on one
GPU); the multi-rank checks of the same paths run through gloo in tests/dist/test_foreach.py.
"""

import copy

import pytest
import torch
from torch.optim.optimizer import _default_to_fused_or_foreach
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import sbpflow

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


class _Calls(TorchDispatchMode):
    """The ATen calls made on global tensors (above their dispatch), and those dispatched."""

    def __init__(self) -> None:
        super().__init__()
        self.on_globals: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if any(isinstance(a, sbpflow.GlobalTensor) for a in tree_flatten((args, kwargs))[0]):
            self.on_globals.append(str(func))
        return func(*args, **kwargs)


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_cuda_optimizer_defaults_to_foreach_on_global_parameters(optimizer):
    """AdamW/SGD with torch's defaults and clip_grad_norm_ on a global CUDA MLP take the
    foreach path, dispatch once per _foreach_* call and train 3 steps as the plain model."""
    placement = sbpflow.placement("cuda", [0])
    torch.manual_seed(0)
    reference = torch.nn.Sequential(
        torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 8)
    ).cuda()
    model = copy.deepcopy(reference).to_global(placement, sbpflow.sbp.broadcast)
    assert _default_to_fused_or_foreach(list(model.parameters()), False) == (False, True)
    make = {
        "adamw": lambda ps: torch.optim.AdamW(ps, lr=0.05, weight_decay=0.1),
        "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    }[optimizer]
    opt_ref, opt = make(reference.parameters()), make(model.parameters())
    x, y = torch.randn(12, 16, device="cuda"), torch.randn(12, 8, device="cuda")
    gx, gy = (t.to_global(placement, sbpflow.sbp.split(0)) for t in (x, y))
    dispatcher = sbpflow.GlobalTensor._op_dispatcher
    inner = dispatcher.dispatch
    seen: list[str] = []
    for _ in range(3):
        opt_ref.zero_grad()
        ((reference(x) - y) ** 2).mean().backward()
        norm_ref = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.5)
        opt_ref.step()
        opt.zero_grad()
        ((model(gx) - gy) ** 2).mean().backward()
        seen.clear()
        dispatcher.dispatch = lambda f, a, k: (seen.append(str(f)), inner(f, a, k))[1]
        try:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            assert "aten._foreach_norm.Scalar" in seen
            seen.clear()
            calls = _Calls()
            with calls:
                opt.step()
        finally:
            del dispatcher.dispatch
        assert any("_foreach_" in c for c in calls.on_globals), calls.on_globals
        assert seen == calls.on_globals
        assert abs(norm.to_local().item() - norm_ref.item()) < 1e-5
    for p, ref in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.allclose(p.to_local(), ref, atol=1e-5), (p.to_local() - ref).abs().max()
