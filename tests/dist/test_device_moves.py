"""Dtype and device moves of global tensors and modules on 2 ranks (NOTE [device moves]).

Every value is compared with plain single-process PyTorch computed in the same job
from the same logical tensors: ``g.to(torch.bfloat16)``, ``.double()``, ``.half()``,
``g.to(other)``, ``g.type(...)``, ``g.to(device, dtype)`` keep the layout (a partial
tensor is reduced first when the cast would round each part), their backward equals
plain autograd, and ``module.double()`` trains like the plain model through each of
``Module._apply``'s paths (``p.data = ...``, ``swap_tensors``, new Parameters). On a
machine without CUDA every cuda move raises an error saying what to do; the moves
themselves are checked in tests/gpu/test_cuda_moves.py.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from torch import nn

import sbpflow
from sbpflow.sbp import Broadcast, Partial, Split, sbp_str
from sbpflow.testing import get_pool

S0, S1, B, P = Split(0), Split(1), Broadcast(), Partial("sum")
_WORLD = 2


def _world() -> sbpflow.Placement:
    return sbpflow.placement("cpu", list(range(sbpflow.env.get_world_size())))


def _logical(t: torch.Tensor) -> torch.Tensor:
    """The logical value of a global tensor, on every rank (a collective)."""
    return t.to_global(sbp=(B,) * len(t.sbp), check_meta=False).to_local().detach()


def _global_leaf(x: torch.Tensor, sbp: Any) -> torch.Tensor:
    """A global leaf requiring grad whose logical value is ``x`` (the same on every rank)."""
    return x.to_global(_world(), B).to_global(sbp=sbp).detach().requires_grad_()


# (label, the move, whether it may reduce a partial input first)
_MOVES: list[tuple[str, Callable[[torch.Tensor], torch.Tensor], bool]] = [
    ("to(bfloat16)", lambda t: t.to(torch.bfloat16), True),
    ("half()", lambda t: t.half(), True),
    ("double()", lambda t: t.double(), False),
    ("to(other float64)", lambda t: t.to(torch.zeros(1, dtype=torch.float64)), False),
    ("type(DoubleTensor)", lambda t: t.type(torch.DoubleTensor), False),
    ("to('cpu', float64)", lambda t: t.to("cpu", torch.float64), False),
    ("to(float64, non_blocking)", lambda t: t.to(torch.float64, non_blocking=True), False),
    ("to(float32, copy=True)", lambda t: t.to(torch.float32, copy=True), False),
]


def dtype_moves_job() -> list[dict[str, Any]]:
    """Each move of S(0), S(1), B and P tensors: forward value, layout, backward."""
    torch.manual_seed(0)
    x = torch.randn(6, 5)
    weights = torch.randn(6, 5, dtype=torch.float64)
    out = []
    for sbp in (S0, S1, B, P):
        for label, move, may_reduce in _MOVES:
            ref_x = x.clone().requires_grad_()
            ref_y = move(ref_x)
            (ref_y.double() * weights).sum().backward()
            g = _global_leaf(x, sbp)
            y = move(g)
            (y.double() * weights.to_global(_world(), B)).sum().backward()
            assert g.grad is not None
            out.append(
                {
                    "case": f"{label} of {sbp}",
                    "value": (_logical(y).double() - ref_y.detach().double()).abs().max().item(),
                    "dtype": (y.dtype, y.to_local().dtype, ref_y.dtype),
                    "device": (y.device.type, y.to_local().device.type, y.placement.type),
                    "sbp": (sbp_str(g.sbp), sbp_str(y.sbp), may_reduce),
                    "grad": (_logical(g.grad).double() - ref_x.grad.double()).abs().max().item(),
                    "grad_sbp": sbp_str(g.grad.sbp),
                    "shares_memory": y.to_local().data_ptr() == g.to_local().data_ptr(),
                }
            )
    return out


def test_dtype_moves_keep_layout_and_equal_plain_torch() -> None:
    """Every dtype move of S(0), S(1), B and P tensors equals the plain move (value and
    gradient), keeps the layout (a lossy cast of P reduces it
    first, to B or a split), keeps the
    locals on cpu and copies; the leaf's gradient keeps the leaf's layout."""
    for rank, cases in enumerate(get_pool(_WORLD).run(dtype_moves_job)):
        assert len(cases) == 4 * len(_MOVES)
        for c in cases:
            where = f"rank {rank}, {c['case']}"
            tol = 1e-2 if c["dtype"][2] in (torch.bfloat16, torch.float16) else 1e-6
            assert c["value"] <= tol, f"{where}: value differs by {c['value']}"
            assert c["grad"] <= tol, f"{where}: gradient differs by {c['grad']}"
            logical, local, want = c["dtype"]
            assert logical == local == want, f"{where}: dtypes {c['dtype']}"
            assert c["device"] == ("cpu", "cpu", "cpu"), f"{where}: devices {c['device']}"
            before, after, may_reduce = c["sbp"]
            reduced = may_reduce and before == "P" and after in ("B", "S(0)", "S(1)")
            assert after == before or reduced, f"{where}: layout {before} -> {after}"
            assert c["grad_sbp"] == before, f"{where}: .grad is {c['grad_sbp']}"
            assert not c["shares_memory"], f"{where}: the move returned the input's memory"


def no_op_moves_job() -> dict[str, Any]:
    g = torch.randn(4, 3).to_global(_world(), B).to_global(sbp=S0)
    return {
        "cpu()": g.cpu() is g,
        "to('cpu')": g.to("cpu") is g,
        "to(float32)": g.to(torch.float32) is g,
        "to(g)": g.to(g) is g,
        "to(torch.device('cpu'), float32)": g.to(torch.device("cpu"), torch.float32) is g,
        "float()": g.float() is g,
    }


def test_moves_to_where_a_tensor_is_return_it() -> None:
    """As plain torch: a move to the tensor's own device and dtype returns the tensor itself."""
    for rank, got in enumerate(get_pool(_WORLD).run(no_op_moves_job)):
        assert all(got.values()), f"rank {rank}: not returned as is: {got}"


def outside_rank_job() -> dict[str, Any]:
    """A tensor on placement [0] only, cast on both ranks."""
    g = torch.randn(4, 3).to_global(sbpflow.placement("cpu", [0]), B)
    y = g.double()
    return {
        "dtype": (y.dtype, y.to_local().dtype),
        "numel": y.to_local().numel(),
        "device": y.to_local().device.type,
        "placement": str(y.placement),
    }


def test_rank_outside_the_placement_holds_an_empty_local_of_the_new_dtype() -> None:
    """Rank 1, outside placement [0], holds an empty float64 cpu local after ``double()``;
    rank 0 holds the whole (4, 3) tensor."""
    got = get_pool(_WORLD).run(outside_rank_job)
    for rank, g in enumerate(got):
        assert g["dtype"] == (torch.float64, torch.float64), f"rank {rank}: {g}"
        assert g["device"] == "cpu" and g["placement"] == "placement('cpu', [0])", g
        assert g["numel"] == (12 if rank == 0 else 0), f"rank {rank}: {g}"


# -- modules --------------------------------------------------------------------------


class _TiedMLP(nn.Module):
    """Embedding -> Linear -> output projection tied to the embedding."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, 6)
        self.fc = nn.Linear(6, 6)
        self.head = nn.Linear(6, 11, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("scale", torch.full((6,), 0.5))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        return self.head(torch.tanh(self.fc(h)) * self.scale + h)


@contextmanager
def _apply_path(path: str) -> Iterator[None]:
    """Select ``Module._apply``'s path: ``p.data = ...`` (torch's default), ``swap_tensors``
    or new Parameters ("overwrite")."""
    swap = torch.__future__.get_swap_module_params_on_conversion()
    overwrite = torch.__future__.get_overwrite_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(path == "swap")
    torch.__future__.set_overwrite_module_params_on_conversion(path == "overwrite")
    try:
        yield
    finally:
        torch.__future__.set_swap_module_params_on_conversion(swap)
        torch.__future__.set_overwrite_module_params_on_conversion(overwrite)


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(5)
    return torch.randint(0, 11, (8, 3), generator=gen), torch.randint(0, 11, (8, 3), generator=gen)


def _loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten())


def module_dtype_job(path: str, move: str) -> dict[str, Any]:
    """``move`` (``double()`` or ``to(float64)``) a global tied model after one step (so
    ``.grad`` exists and moves too), then train 3 steps with an optimizer built after the
    move; the plain model does the same under the same ``_apply`` path."""
    pl, rank = _world(), sbpflow.env.get_rank()
    torch.manual_seed(0)
    reference = _TiedMLP()
    model = copy.deepcopy(reference).to_global(pl, B)
    x, y = _batch()
    gx = torch.tensor_split(x, _WORLD)[rank].contiguous().to_global(pl, S0)
    gy = torch.tensor_split(y, _WORLD)[rank].contiguous().to_global(pl, S0)
    _loss(reference(x), y).backward()
    _loss(model(gx), gy).backward()
    params_before = {n: p for n, p in model.named_parameters()}
    # A global tensor is a traceable wrapper subclass, so ``Module._apply`` swaps it on
    # every path (as it does DTensor): with the overwrite flag too, parameters stay the same
    # objects and ties stay tied. The plain reference then moves with torch's default path,
    # the one that keeps its tie too.
    for m, m_path in ((reference, "set_data" if path == "overwrite" else path), (model, path)):
        with _apply_path(m_path):
            if move == "double()":
                m.double()
            else:
                m.to(torch.float64)
    opt_ref = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for _ in range(3):
        opt_ref.zero_grad()
        want = _loss(reference(x), y)
        want.backward()
        opt_ref.step()
        opt.zero_grad()
        got = _loss(model(gx), gy)
        got.backward()
        grad_sbps = {n: sbp_str(p.grad.sbp) for n, p in model.named_parameters()}
        opt.step()
        losses.append((got.item(), want.item()))
    ref_state = dict(reference.named_parameters()) | dict(reference.named_buffers())
    state = dict(model.named_parameters()) | dict(model.named_buffers())
    return {
        "losses": losses,
        "errors": {
            n: (_logical(t).double() - ref_state[n].detach()).abs().max().item()
            for n, t in state.items()
        },
        "dtypes": {n: (t.dtype, t.to_local().dtype) for n, t in state.items()},
        "sbps": {n: sbp_str(p.sbp) for n, p in model.named_parameters()},
        "grad_sbps": grad_sbps,
        "is_parameter": all(isinstance(p, nn.Parameter) for p in model.parameters()),
        "tied": (
            model.embed.weight is model.head.weight,
            reference.embed.weight is reference.head.weight,
        ),
        "same_objects": all(params_before[n] is p for n, p in model.named_parameters()),
        "ref_same_objects": True,
    }


_PATHS = ("set_data", "swap", "overwrite")


@pytest.mark.parametrize("move", ["double()", "to(float64)"])
def test_module_dtype_move_trains_like_plain_torch(move: str) -> None:
    """``model.double()`` / ``model.to(torch.float64)`` of a data-parallel model with a tied
    weight and a buffer, through each ``Module._apply`` path: every parameter and buffer
    (and its local) is float64, stays a broadcast Parameter, tied exactly when plain torch
    keeps the tie, gradients arrive broadcast, and 3 SGD steps equal single-process
    training of the plain model moved the same way."""
    pool = get_pool(_WORLD)
    for path in _PATHS:
        for rank, got in enumerate(pool.run(module_dtype_job, path, move)):
            where = f"rank {rank}, {path}"
            for step, (loss, want) in enumerate(got["losses"]):
                assert loss == pytest.approx(want, abs=1e-9), (
                    f"{where}: step {step} {got['losses']}"
                )
            bad = {n: e for n, e in got["errors"].items() if e > 1e-9}
            assert not bad, f"{where}: differ from the plain model by {bad}"
            assert all(d == (torch.float64, torch.float64) for d in got["dtypes"].values()), (
                f"{where}: dtypes {got['dtypes']}"
            )
            assert set(got["sbps"].values()) == {"B"}, f"{where}: layouts {got['sbps']}"
            assert set(got["grad_sbps"].values()) == {"B"}, f"{where}: .grad {got['grad_sbps']}"
            assert got["is_parameter"], f"{where}: a parameter is no longer an nn.Parameter"
            tied, ref_tied = got["tied"]
            assert tied == ref_tied, f"{where}: tied {tied}, plain torch tied {ref_tied}"
            assert tied, f"{where}: the tie was broken"
            assert got["same_objects"] == got["ref_same_objects"], f"{where}: parameters replaced"


# -- errors ---------------------------------------------------------------------------


def _error_of(fn: Callable[[], Any]) -> tuple[str, str]:
    try:
        fn()
    except (RuntimeError, ValueError, TypeError) as error:
        return type(error).__name__, str(error)
    return "no error", ""


def errors_job() -> dict[str, tuple[str, str]]:
    g = torch.randn(4, 3).to_global(_world(), B).to_global(sbp=S0)
    model = nn.Linear(3, 2).to_global(_world(), B)
    p = model.weight
    cases: dict[str, Callable[[], Any]] = {
        "g.cuda()": g.cuda,
        "g.to('cuda')": lambda: g.to("cuda"),
        "g.to('cuda', float16)": lambda: g.to("cuda", torch.float16),
        "g.to(device='cuda')": lambda: g.to(device="cuda"),
        "model.cuda()": model.cuda,
        "model.to('cuda')": lambda: model.to("cuda"),
        "g.to_global(cuda placement)": lambda: g.to_global(sbpflow.placement("cuda", [0, 1])),
    }
    out = {label: _error_of(fn) for label, fn in cases.items()}
    out["model intact"] = (
        str((model.weight is p, model.weight.device.type, model.weight.placement.type)),
        "",
    )
    out["g.to('meta')"] = _error_of(lambda: g.to("meta"))
    out["g.to('cpu:1')"] = _error_of(lambda: g.to("cpu:1"))
    out["p.data = plain"] = _error_of(lambda: setattr(p, "data", torch.zeros(2, 3)))
    out["g * meta plain"] = _error_of(lambda: g * torch.zeros(4, 3, device="meta"))
    return out


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="with CUDA the moves work: tests/gpu/test_cuda_moves.py"
)
def test_cuda_moves_without_cuda_say_what_to_do() -> None:
    """Without CUDA, ``g.cuda()``, ``g.to('cuda')``, ``module.cuda()``, ``module.to('cuda')``
    and boxing to a cuda placement raise (before torch's own CUDA error) naming the cuda placement and what to do, and leave
    the module as it was; ``g.to('meta')``, ``g.to('cpu:1')``, ``p.data = plain_tensor`` and
    an op mixing a global tensor with a plain one on another device are clear errors too."""
    for rank, got in enumerate(get_pool(_WORLD).run(errors_job)):
        for label in (
            "g.cuda()",
            "g.to('cuda')",
            "g.to('cuda', float16)",
            "g.to(device='cuda')",
            "g.to_global(cuda placement)",
        ):
            kind, message = got[label]
            assert kind == "RuntimeError", f"rank {rank}, {label}: {kind} {message}"
            assert "CUDA is not available" in message and "placement('cuda', [0, 1])" in message
            assert "keep it on placement('cpu', [0, 1])" in message, message
        for label in ("model.cuda()", "model.to('cuda')"):
            kind, message = got[label]
            assert kind == "RuntimeError" and "CUDA is not available" in message, (label, message)
        assert got["model intact"][0] == "(True, 'cpu', 'cpu')", got["model intact"]
        kind, message = got["g.to('meta')"]
        assert kind == "ValueError" and "'meta'" in message and "to_local()" in message, message
        kind, message = got["g.to('cpu:1')"]
        assert kind == "ValueError" and "cpu:1" in message and "g.to('cpu')" in message, message
        kind, message = got["p.data = plain"]
        assert kind == "TypeError" and "plain Tensor" in message and "to_global" in message
        kind, message = got["g * meta plain"]
        assert kind == "ValueError" and "plain tensor on meta" in message, message
        assert ".to('cpu')" in message and "placement('cpu', [0, 1])" in message, message
