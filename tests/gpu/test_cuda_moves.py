"""GPU tier: moving global tensors and modules between cpu and cuda (NOTE [device moves]).

Skipped when CUDA is absent. NCCL refuses two ranks on one GPU, so the moves run
at world size 1 in this process, and the one 2-rank check keeps every collective
on gloo: its cuda placement holds rank 0 alone, and rank 1 (outside it) must hold
empty locals on its own cuda device. Every value is compared with plain
single-process PyTorch computed in the same test.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import sbpflow
from sbpflow.sbp import Broadcast, Partial, Split
from sbpflow.testing import get_pool
from tests.dist.test_device_moves import _apply_path, _loss, _TiedMLP

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

S0, S1, B, P = Split(0), Split(1), Broadcast(), Partial("sum")
CPU = sbpflow.placement("cpu", [0])
CUDA = sbpflow.placement("cuda", [0])


def _own() -> torch.device:
    """The rank's cuda device: cuda:LOCAL_RANK (0 in this process)."""
    return torch.device("cuda", sbpflow.env.get_local_rank() % torch.cuda.device_count())


_TO_CUDA: list[tuple[str, Callable[[torch.Tensor], torch.Tensor], torch.dtype]] = [
    ("cuda()", lambda t: t.cuda(), torch.float32),
    ("cuda(0)", lambda t: t.cuda(0), torch.float32),
    ("to('cuda')", lambda t: t.to("cuda"), torch.float32),
    ("to('cuda:0')", lambda t: t.to("cuda:0"), torch.float32),
    ("to(device='cuda')", lambda t: t.to(device=torch.device("cuda")), torch.float32),
    ("to(cuda tensor)", lambda t: t.to(torch.zeros(1, device="cuda")), torch.float32),
    (
        "to(cuda float64 tensor)",
        lambda t: t.to(torch.zeros(1, 1, device="cuda").double()),
        torch.float64,
    ),
    ("to('cuda', float16)", lambda t: t.to("cuda", torch.float16), torch.float16),
    ("to('cuda', non_blocking)", lambda t: t.to("cuda", non_blocking=True), torch.float32),
    ("to('cuda', copy=True)", lambda t: t.to("cuda", copy=True), torch.float32),
    ("type(cuda.DoubleTensor)", lambda t: t.type(torch.cuda.DoubleTensor), torch.float64),
]


@pytest.mark.parametrize("sbp", [S0, S1, B, P], ids=str)
@pytest.mark.parametrize("label,move,dtype", _TO_CUDA, ids=[m[0] for m in _TO_CUDA])
def test_tensor_to_cuda_and_back(sbp: Any, label: str, move: Any, dtype: torch.dtype) -> None:
    """A cpu global moved to cuda is on placement('cuda', [0]) with the same SBP, its local
    on cuda:0, equal to the plain move; ``.cpu()`` brings it back to placement('cpu', [0])."""
    x = torch.randn(6, 5)
    g = x.to_global(CPU, sbp)
    c = move(g)
    torch.cuda.synchronize()
    assert c.placement == CUDA, c.placement
    # A cast runs the ``_to_copy`` rule, which on a one-rank mesh may relabel the SBP with
    # an equivalent one (every SBP means the same there); a pure move keeps it as it is.
    if dtype == torch.float32:
        assert c.sbp == g.sbp, (g.sbp, c.sbp)
    assert c._layout.normalized().sbp == g._layout.normalized().sbp
    assert c.device == _own() and c.to_local().device == _own(), c.to_local().device
    assert c.dtype == c.to_local().dtype == dtype
    assert torch.equal(c.to_local().cpu(), x.to(dtype))
    back = c.cpu()
    assert back.placement == CPU and back.sbp == c.sbp and back.to_local().device.type == "cpu"
    assert torch.equal(back.to_local(), x.to(dtype))


def test_moves_to_where_a_cuda_tensor_is_return_it() -> None:
    """As plain torch: ``c.cuda()`` and ``c.to(<its own device>)`` return ``c`` itself."""
    c = torch.randn(3, 4).to_global(CPU, S0).cuda()
    assert c.cuda() is c and c.to(_own()) is c and c.to(torch.float32) is c


@pytest.mark.parametrize("sbp", [S0, B, P], ids=str)
def test_move_backward_equals_plain_autograd(sbp: Any) -> None:
    """Gradients cross a device move: a cpu leaf moved to cuda (and a cuda leaf moved to
    cpu) gets the plain gradient, on its own placement and in its own layout."""
    x = torch.randn(4, 3)
    w = torch.randn(4, 3)
    ref = x.clone().requires_grad_()
    (ref.cuda() * w.cuda()).sum().backward()
    for start in (CPU, CUDA):
        g = x.to_global(CPU, sbp)
        leaf = (g if start == CPU else g.cuda()).detach().requires_grad_()
        moved = leaf.cuda() if start == CPU else leaf.cpu()
        other = w.to_global(moved.placement, B)
        (moved * other).sum().backward()
        assert leaf.grad is not None and leaf.grad.placement == start, leaf.grad
        assert leaf.grad.sbp == leaf.sbp
        assert torch.allclose(leaf.grad.to_local().cpu(), ref.grad, atol=1e-6)


@pytest.mark.parametrize("dst", [S0, B], ids=str)
def test_boxing_to_a_cuda_placement_moves_then_boxes(dst: Any) -> None:
    """``g.to_global(placement('cuda', [0]), sbp)`` of a cpu tensor: its local on cuda:0 with
    the plain value, and the gradient back on the cpu placement in the leaf's layout."""
    x = torch.randn(4, 3)
    leaf = x.to_global(CPU, S1).detach().requires_grad_()
    c = leaf.to_global(CUDA, dst)
    assert c.placement == CUDA and c.sbp == (dst,) and c.to_local().device == _own()
    assert torch.equal(c.to_local().cpu(), x)
    (c * c).sum().backward()
    assert leaf.grad is not None and leaf.grad.placement == CPU and leaf.grad.sbp == (S1,)
    assert torch.allclose(leaf.grad.to_local(), 2 * x, atol=1e-6)


def test_plain_cpu_tensor_with_a_cuda_global_is_an_error() -> None:
    """As plain torch refuses mixing devices: a plain cpu tensor in an op on a cuda global
    tensor is an error naming both devices and the fix, not a cuda placement holding cpu."""
    c = torch.randn(4, 3).to_global(CPU, S0).cuda()
    with pytest.raises(ValueError, match=r"plain tensor on cpu.*placement\('cuda', \[0\]\)"):
        c * torch.ones(4, 3)


def test_move_to_another_cuda_device_is_an_error() -> None:
    """``g.to('cuda:1')`` where this rank uses cuda:0 names both devices and the fix."""
    g = torch.randn(4, 3).to_global(CPU, S0)
    with pytest.raises(ValueError, match=r"cuda:1.*cuda:0.*g.to\('cuda'\) without an index"):
        g.to("cuda:1")
    with pytest.raises(ValueError, match=r"cuda:1"):
        g.cuda(1)


_MODULE_MOVES: dict[str, Callable[[nn.Module], Any]] = {
    "cuda()": lambda m: m.cuda(),
    "to('cuda')": lambda m: m.to("cuda"),
    "to('cuda', float64)": lambda m: m.to("cuda", torch.float64),
}


@pytest.mark.parametrize("path", ["set_data", "swap", "overwrite"])
@pytest.mark.parametrize("move", list(_MODULE_MOVES))
def test_module_to_cuda_trains_like_plain_torch(path: str, move: str) -> None:
    """``module.cuda()`` / ``.to('cuda')`` / ``.to('cuda', float64)`` of a global model with a
    tied weight, a buffer and existing ``.grad``s, through each ``Module._apply`` path: every
    parameter, gradient and buffer is on placement('cuda', [0]) with its local on cuda:0,
    parameters stay Parameters and stay tied, and 3 SGD steps
    with an optimizer built after the move equal the plain model moved the same way;
    ``module.cpu()`` brings it all back."""
    torch.manual_seed(0)
    reference = _TiedMLP()
    model = copy.deepcopy(reference).to_global(CPU, B)
    gen = torch.Generator().manual_seed(5)
    x, y = torch.randint(0, 11, (8, 3), generator=gen), torch.randint(0, 11, (8, 3), generator=gen)
    gx, gy = x.to_global(CPU, S0), y.to_global(CPU, S0)
    _loss(reference(x), y).backward()
    _loss(model(gx), gy).backward()
    # Global tensors are swapped on every Module._apply path (tests/dist/test_device_moves.py):
    # the plain reference moves with torch's default path, which keeps its tie too.
    with _apply_path("set_data" if path == "overwrite" else path):
        _MODULE_MOVES[move](reference)
    with _apply_path(path):
        _MODULE_MOVES[move](model)
    state = dict(model.named_parameters()) | dict(model.named_buffers())
    for name, t in state.items():
        assert t.placement == CUDA and t.to_local().device == _own(), (name, t.placement)
    for name, p in model.named_parameters():
        assert isinstance(p, nn.Parameter) and p.requires_grad, name
        assert p.grad is not None and p.grad.placement == CUDA, (name, p.grad)
    assert model.embed.weight is model.head.weight, "the tie was broken"
    assert reference.embed.weight is reference.head.weight
    gx, gy = gx.cuda(), gy.cuda()
    xc, yc = x.cuda(), y.cuda()
    opt_ref = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(3):
        opt_ref.zero_grad()
        want = _loss(reference(xc), yc)
        want.backward()
        opt_ref.step()
        opt.zero_grad()
        got = _loss(model(gx), gy)
        got.backward()
        opt.step()
        assert got.item() == pytest.approx(want.item(), abs=1e-5), f"step {step}"
    ref_state = dict(reference.named_parameters()) | dict(reference.named_buffers())
    for name, t in state.items():
        assert torch.allclose(t.to_local(), ref_state[name].detach(), atol=1e-5), name
    with _apply_path(path):
        model.cpu()
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        assert t.placement == CPU and t.to_local().device.type == "cpu", (name, t.placement)
        assert torch.allclose(t.to_local(), ref_state[name].detach().cpu(), atol=1e-5), name


# -- a rank outside the cuda placement (2 ranks; collectives stay on gloo) --------------


def outside_rank_job() -> dict[str, Any]:
    """Placement [0] only: move to cuda, compute there, move back."""
    rank = sbpflow.env.get_rank()
    x = torch.arange(12, dtype=torch.float32).reshape(4, 3)
    g = x.to_global(CPU, B)
    c = g.cuda()
    doubled = c * 2  # an op on the cuda placement: rank 1 skips it
    back = doubled.cpu()
    own = torch.device("cuda", sbpflow.env.get_local_rank() % torch.cuda.device_count())
    return {
        "rank": rank,
        "placements": (str(c.placement), str(doubled.placement), str(back.placement)),
        "devices": (c.to_local().device == own, doubled.to_local().device == own),
        "back_device": back.to_local().device.type,
        "numels": (c.to_local().numel(), doubled.to_local().numel()),
        "value": back.to_local().tolist(),
        "want": (x * 2).tolist(),
    }


def test_rank_outside_a_cuda_placement_holds_empty_cuda_locals() -> None:
    """On 2 ranks, a tensor on placement [0] moved to cuda: rank 1 (outside) holds empty
    locals on its own cuda device, so ``t.device`` agrees with the placement; rank 0's
    result, moved back to cpu, equals plain ``x * 2``."""
    for got in get_pool(2).run(outside_rank_job):
        assert got["placements"] == (
            "placement('cuda', [0])",
            "placement('cuda', [0])",
            "placement('cpu', [0])",
        ), got
        assert got["devices"] == (True, True) and got["back_device"] == "cpu", got
        if got["rank"] == 0:
            assert got["numels"] == (12, 12) and got["value"] == got["want"], got
        else:
            assert got["numels"] == (0, 0), got
