"""A global model's gradients reduced in buckets with nothing to call, against single-process
training computed in the same job.

The program is the plain one: ``model.to_global(placement, broadcast)``, the batch
``split(0)``, a plain optimizer; no ``sync_gradients``. Each test compares the parameters
(or gradients) with the same model trained in one process on the whole batch, and records
from outside what ran: every bucket's ``all_reduce_async`` (``_recording_launches``) and
the collectives boxing traced. Cases: overlap with backward, accumulation over several
backward passes without ``no_sync``, DP x TP on a 2x2 mesh, a parameter used twice,
gradients read between backward and step (``clip_grad_norm_``), ``torch.autograd.grad``,
reentrant activation checkpointing, ``zero_grad`` both ways, a ``.grad`` kept by the user,
a dtype change after the buckets were made, a backward that raised, bare leaves, ranks
that disagree on the parameters, and a dropped model freeing its buckets.
"""

from __future__ import annotations

import copy
import gc
import weakref
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import sbpflow
from sbpflow._layout import Layout
from sbpflow.nn.parallel import DistributedDataParallel, no_sync, sync_gradients
from sbpflow.nn.parallel._default import _check_same_order
from sbpflow.nn.parallel._params import GlobalParam
from sbpflow.nn.parallel._reducer import GradientSync
from sbpflow.sbp import Broadcast, Split, sbp_str
from sbpflow.testing import get_pool
from tests.dist.test_data_parallel import Net, _errors, _micro_batches, _recording_launches

S0, S1, B = Split(0), Split(1), Broadcast()
_TOL = 1e-5


def _world() -> sbpflow.Placement:
    return sbpflow.placement("cpu", list(range(sbpflow.env.get_world_size())))


def _split_batch(placement: sbpflow.Placement, *tensors: torch.Tensor) -> list[Any]:
    """The same logical tensors on every rank, made global split(0) over ``placement``."""
    return [t.to_global(placement, B).to_global(sbp=S0) for t in tensors]


def _logical(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.to_global(sbp=B).to_local().detach() for n, p in model.named_parameters()}


# -- overlap -------------------------------------------------------------------------------


class Wide(nn.Module):
    """4 layers of 1 MiB weights: the first default bucket (1 MiB) holds the last layer."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(*[nn.Linear(512, 512) for _ in range(4)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


def overlap_job() -> dict[str, Any]:
    placement = _world()
    torch.manual_seed(0)
    reference = Wide()
    model = copy.deepcopy(reference).to_global(placement, B)
    events: list[str] = []
    for name, p in model.named_parameters():
        p.register_hook(lambda g, name=name: events.append(f"grad {name}"))
    x = torch.randn(4, 512, generator=torch.Generator().manual_seed(1))
    (gx,) = _split_batch(placement, x)
    per_backward = []
    for _ in range(2):  # the first backward finds the parameters; the second overlaps
        model.zero_grad()
        events.clear()
        with _recording_launches(events):
            model(gx).pow(2).sum().backward()
        per_backward.append(list(events))
    reference(x).pow(2).sum().backward()
    errors = {
        n: (p.grad.to_global(sbp=B).to_local() - reference.get_parameter(n).grad).abs().max().item()
        for n, p in model.named_parameters()
    }
    return {"events": per_backward, "errors": errors}


def test_first_bucket_launches_before_backward_reaches_the_first_layer() -> None:
    """No call, default buckets: the first backward reduces its gradients in the buckets
    (launched at its end, once they are made); from the second backward on, the bucket of
    the last layer (the 1 MiB first bucket) is launched while backward has not yet computed
    the first layer's gradients; the rest is one bucket launched at the end. Gradients equal
    one process's."""
    for got in get_pool(2).run(overlap_job):
        first, second = got["events"]
        launched = [i for i, e in enumerate(first) if e.startswith("launch")]
        computed = [i for i, e in enumerate(first) if e.startswith("grad")]
        assert len(launched) == 2 and min(launched) > max(computed), first
        assert [first[i] for i in launched] == [e for e in second if e.startswith("launch")], (
            first,
            second,
        )
        launches = [i for i, e in enumerate(second) if e.startswith("launch")]
        first_layer = [i for i, e in enumerate(second) if e.startswith("grad layers.0.")]
        assert len(launches) == 2 and first_layer, second
        assert launches[0] < min(first_layer), second
        assert second[launches[0]] == f"launch {512 * 512 + 512 + 2} over [0, 1]", second
        assert max(got["errors"].values()) < _TOL, got["errors"]


# -- accumulation, parameters used twice, reads between backward and step ------------------


class Twice(nn.Module):
    """``shared`` is applied twice in one forward; ``head`` once."""

    def __init__(self) -> None:
        super().__init__()
        self.shared = nn.Linear(6, 6)
        self.head = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.shared(torch.tanh(self.shared(x)))))


def accumulation_job(kind: str) -> dict[str, Any]:
    """5 SGD steps of ``kind``:

    - ``accumulate``: 4 backward passes per step, all reduced (no no_sync), ``Net``;
    - ``twice``: one backward per step through a layer used twice (``Twice``);
    - ``clip``: ``clip_grad_norm_`` between backward and step, and the gradients read there.
    """
    placement = _world()
    torch.manual_seed(0)
    reference: nn.Module = Twice() if kind == "twice" else Net()
    model = copy.deepcopy(reference).to_global(placement, B)
    opt_ref = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    num_micro = 4 if kind == "accumulate" else 1
    launches_per_step, norms, grad_errors = [], [], []
    for step in range(5):
        batches = _micro_batches(step, num_micro)
        opt_ref.zero_grad()
        opt.zero_grad()
        events: list[str] = []
        for x, y in batches:
            F.mse_loss(reference(x), y).backward()
            gx, gy = _split_batch(placement, x, y)
            with _recording_launches(events):
                F.mse_loss(model(gx), gy).backward()
        launches_per_step.append(len(events))
        if kind == "clip":
            norm_ref = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.05)
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
            norms.append((float(norm), float(norm_ref)))
            grad_errors.append(
                max(
                    (p.grad.to_local() - reference.get_parameter(n).grad).abs().max().item()
                    for n, p in model.named_parameters()
                    if p.grad is not None
                )
            )
        opt_ref.step()
        opt.step()
    return {
        "errors": _errors(_logical(model), reference),
        "launches": launches_per_step,
        "norms": norms,
        "grad_errors": grad_errors,
        "grad_sbps": sorted(
            {sbp_str(p.grad.sbp) for p in model.parameters() if p.grad is not None}
        ),
    }


@pytest.mark.parametrize("kind", ["accumulate", "twice", "clip"])
def test_default_buckets_match_single_process(kind: str) -> None:
    """No call: accumulation over 4 backward passes per step without no_sync (each reduced,
    the sums equal), a layer used twice in one forward, and gradients read and clipped with
    clip_grad_norm_ between backward and step (they are reduced: this rank's piece of
    ``.grad`` is the whole gradient, and the norm is one process's) all equal one process;
    every backward, the first one included, launches one bucket."""
    for got in get_pool(2).run(accumulation_job, kind):
        assert not got["errors"], got
        per_backward = 4 if kind == "accumulate" else 1
        assert got["launches"] == [per_backward] * 5, got["launches"]
        assert got["grad_sbps"] == ["B"], got
        for norm, norm_ref in got["norms"]:
            assert abs(norm - norm_ref) < _TOL * max(1.0, norm_ref), got["norms"]
        assert all(e < _TOL for e in got["grad_errors"]), got["grad_errors"]


# -- DP x TP on a 2x2 mesh -----------------------------------------------------------------


class Megatron(nn.Module):
    """A column-parallel Linear then a row-parallel one without bias."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(6, 8)
        self.fc2 = nn.Linear(8, 3, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.relu(self.fc1(x)))


def _megatron(name: str, t: torch.Tensor) -> Any:
    return (B, S1) if name == "fc2.weight" else (B, S0)


def mesh_job() -> dict[str, Any]:
    mesh = sbpflow.placement("cpu", [[0, 1], [2, 3]])
    torch.manual_seed(0)
    reference = Megatron()
    model = copy.deepcopy(reference).to_global(mesh, (B, B)).to_global(mesh, _megatron)
    opt_ref = torch.optim.SGD(reference.parameters(), lr=0.1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    launches, traced = [], []
    for step in range(3):
        (x, y) = _micro_batches(step, 1)[0]
        opt_ref.zero_grad()
        F.mse_loss(reference(x), y).backward()
        opt_ref.step()
        opt.zero_grad()
        gx, gy = (t.to_global(mesh, (B, B)).to_global(sbp=(S0, B)) for t in (x, y))
        events: list[str] = []
        with sbpflow.boxing.trace() as t, _recording_launches(events):
            F.mse_loss(model(gx), gy).backward()
        launches.append(events)
        traced.append(dict(t.collectives()))
        opt.step()
    logical = {n: p.to_global(sbp=(B, B)).to_local().detach() for n, p in model.named_parameters()}
    return {
        "errors": _errors(logical, reference),
        "launches": launches,
        "traced": traced,
        "grad_sbps": {
            n: (sbp_str(p.grad.sbp), sbp_str(p.sbp)) for n, p in model.named_parameters()
        },
    }


def test_dp_tp_on_2x2_mesh_reduces_over_the_data_axis_only() -> None:
    """Parameters (B, S(k)), batch (S(0), B), nothing to call: each backward launches one
    bucket, over this rank's data-axis group ([0, 2] or [1, 3])
    and never over the tensor-parallel axis; gradients keep the parameters' layouts and
    training equals one process."""
    for rank, got in enumerate(get_pool(4).run(mesh_job)):
        assert not got["errors"], got
        data_group = "[0, 2]" if rank in (0, 2) else "[1, 3]"
        numel = (8 * 6 + 8) // 2 + 3 * 8 // 2 + 3  # this rank's pieces, then 3 flags
        for events in got["launches"]:  # the first backward's too, at its end
            assert events == [f"launch {numel} over {data_group}"], got["launches"]
        # Every collective of a step: the tensor-parallel boxing (the same each step), and the
        # gradients' reduction: the bucket, the first step included.
        assert got["traced"] == [got["traced"][0]] * len(got["traced"]), got["traced"]
        for grad_sbp, param_sbp in got["grad_sbps"].values():
            assert grad_sbp == param_sbp, got["grad_sbps"]


# -- autograd.grad, reentrant checkpointing, create_graph -------------------------------------


class SharedUnderCheckpoint(nn.Module):
    """``shared`` runs inside a reentrant checkpoint and outside it: two AccumulateGrads
    (``checkpointed=False``: twice, no checkpoint, for what reentrant checkpointing refuses)."""

    def __init__(self, checkpointed: bool) -> None:
        super().__init__()
        self.checkpointed = checkpointed
        self.first = nn.Linear(6, 6)
        self.shared = nn.Linear(6, 6)
        self.last = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.first(x)
        if self.checkpointed:
            inner = torch.utils.checkpoint.checkpoint(self.shared, h, use_reentrant=True)
        else:
            inner = self.shared(h)
        return self.last(self.shared(h) + inner)


def autograd_paths_job(case: str) -> dict[str, Any]:
    """4 steps; ``case``: ``checkpoint`` (reentrant, default buckets), ``checkpoint, small
    buckets`` (sync_gradients with a bucket per parameter, so a bucket is launched before
    its parameter's second gradient), ``autograd.grad`` (the gradients returned, .grad
    untouched), ``create_graph`` (backward(create_graph=True): .grad keeps its history);
    the last two without the checkpoint, which refuses them."""
    placement = _world()
    torch.manual_seed(0)
    reference = SharedUnderCheckpoint(checkpointed=case.startswith("checkpoint"))
    model = copy.deepcopy(reference).to_global(placement, B)
    if case == "checkpoint, small buckets":
        sync_gradients(model, bucket_cap_mb=1e-6)
    out: dict[str, Any] = {"grad_errors": [], "launches": [], "layouts": set(), "history": []}
    for step in range(4):
        (x, y) = _micro_batches(step, 1)[0]
        x = x[:, :6]
        y = torch.randn(8, 6, generator=torch.Generator().manual_seed(step))
        reference.zero_grad()
        model.zero_grad()
        F.mse_loss(reference(x), y).backward()
        gx, gy = _split_batch(placement, x, y)
        events: list[str] = []
        with _recording_launches(events):
            loss = F.mse_loss(model(gx), gy)
            if case == "autograd.grad" and step > 0:  # step 0's backward joins the buckets
                names = [n for n, _ in model.named_parameters()]
                grads = dict(
                    zip(names, torch.autograd.grad(loss, list(model.parameters())), strict=True)
                )
                out["untouched"] = all(p.grad is None for p in model.parameters())
            elif case == "create_graph":  # joins at step 0's end too (AccumulateGrad ran)
                loss.backward(create_graph=True)
                grads = {n: p.grad for n, p in model.named_parameters()}
                out["history"].append(all(g.grad_fn is not None for g in grads.values()))
            else:
                loss.backward()
                grads = {n: p.grad for n, p in model.named_parameters()}
        out["launches"].append(len(events))
        out["layouts"].update(sbp_str(g.sbp) for g in grads.values())
        out["grad_errors"].append(
            max(
                (g.detach().to_global(sbp=B).to_local() - reference.get_parameter(n).grad)
                .abs()
                .max()
                .item()
                for n, g in grads.items()
            )
        )
    out["layouts"] = sorted(out["layouts"])
    return out


@pytest.mark.parametrize(
    "case", ["checkpoint", "checkpoint, small buckets", "autograd.grad", "create_graph"]
)
def test_gradients_that_are_not_one_plain_backward(case: str) -> None:
    """Reentrant activation checkpointing (a parameter's AccumulateGrad runs twice in one
    backward, with default buckets and with a bucket launched before the second gradient:
    the bucket is reduced again, exactly), torch.autograd.grad (returned broadcast, nothing
    bucketed, .grad left None) and backward(create_graph=True) (per-parameter, .grad with
    its history): every gradient equals one process's, step after step."""
    for got in get_pool(2).run(autograd_paths_job, case):
        assert max(got["grad_errors"]) < _TOL, got
        assert got["layouts"] == ["B"], got
        if case == "autograd.grad":
            assert got["untouched"] and got["launches"] == [1, 0, 0, 0], got  # step 0: backward
        elif case == "create_graph":
            assert all(got["history"]) and got["launches"] == [0] * 4, got
        elif case == "checkpoint":
            assert got["launches"][1:] == [1] * 3, got  # one bucket, once
        else:  # a bucket per parameter (6), and those launched early are launched again
            assert all(n > 6 for n in got["launches"]), got


# -- gradients are views: zero_grad both ways, a .grad kept by the user -----------------------


def zeroing_job(set_to_none: bool | None) -> dict[str, Any]:
    """4 SGD-momentum steps with zero_grad(set_to_none=...) (None: never zeroed)."""
    placement = _world()
    torch.manual_seed(0)
    reference = Net()
    model = copy.deepcopy(reference).to_global(placement, B)
    opt_ref = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    storages: list[set[int]] = []
    counts = []
    for step in range(4):
        (x, y) = _micro_batches(step, 1)[0]
        if set_to_none is not None:
            opt_ref.zero_grad(set_to_none=set_to_none)
            opt.zero_grad(set_to_none=set_to_none)
        F.mse_loss(reference(x), y).backward()
        opt_ref.step()
        gx, gy = _split_batch(placement, x, y)
        with sbpflow.boxing.trace() as t:
            F.mse_loss(model(gx), gy).backward()
        counts.append(t.collectives()["all_reduce"])
        storages.append(
            {
                p.grad.to_local().untyped_storage().data_ptr()
                for p in model.parameters()
                if p.grad is not None
            }
        )
        opt.step()
    return {"errors": _errors(_logical(model), reference), "storages": storages, "counts": counts}


def kept_grad_job(kept_names: tuple[str, ...]) -> dict[str, Any]:
    """A .grad, a slice of another and the ``.detach()`` of a third (sharing its memory, not a
    view of it), or those of them ``kept_names`` names, kept across zero_grad() and the next
    backward."""
    placement = _world()
    torch.manual_seed(0)
    reference = Net()
    model = copy.deepcopy(reference).to_global(placement, B)
    steps = [_micro_batches(step, 1)[0] for step in range(3)]
    reference_grads = []
    for x, y in steps:
        reference.zero_grad()
        F.mse_loss(reference(x), y).backward()
        reference_grads.append(
            {n: p.grad.clone() for n, p in reference.named_parameters() if p.grad is not None}
        )
    kept: dict[str, Any] = {}
    errors = []
    for step, (x, y) in enumerate(steps):
        model.zero_grad()
        gx, gy = _split_batch(placement, x, y)
        F.mse_loss(model(gx), gy).backward()
        if step == 1:  # in the buckets by now: keep two of them, as a user might
            kept = {
                "fc1.weight": model.fc1.weight.grad,
                "fc2.bias[:2]": model.fc2.bias.grad[:2],
                "fc2.weight detached": model.fc2.weight.grad.detach(),
            }
            kept = {n: g for n, g in kept.items() if n in kept_names}
            kept_values = {n: g.to_local().clone() for n, g in kept.items()}
        errors.append(
            max(
                (p.grad.to_local() - reference_grads[step][n]).abs().max().item()
                for n, p in model.named_parameters()
                if p.grad is not None
            )
        )
    unchanged = all(torch.equal(g.to_local(), kept_values[n]) for n, g in kept.items())
    return {"errors": errors, "unchanged": unchanged}


@pytest.mark.parametrize("set_to_none", [True, False, None])
def test_zero_grad_both_ways_with_default_buckets(set_to_none: bool | None) -> None:
    """No call, zero_grad(set_to_none=True/False) or no zeroing (accumulating over steps):
    training equals one process; after the first backward the gradients are views of one
    buffer, the same every step, and each backward runs one all_reduce (its bucket)."""
    for got in get_pool(2).run(zeroing_job, set_to_none):
        assert not got["errors"], got
        assert got["counts"][1:] == [1, 1, 1], got["counts"]
        later = got["storages"][1:]
        assert all(len(s) == 1 for s in later) and len(set.union(*later)) == 1, later


@pytest.mark.parametrize(
    "kept_names", [("fc1.weight", "fc2.bias[:2]", "fc2.weight detached"), ("fc2.weight detached",)]
)
def test_a_kept_gradient_is_not_overwritten(kept_names: tuple[str, ...]) -> None:
    """A user keeps p.grad (a slice of another, the detached gradient of a third) across
    zero_grad() and the next backward: what they hold keeps its values (the bucket moves to
    a new buffer instead of writing over it), and every step's gradients equal one
    process's."""
    for got in get_pool(2).run(kept_grad_job, kept_names):
        assert got["unchanged"], got
        assert max(got["errors"]) < _TOL, got


# -- the parameters change, a backward raises, bare leaves, disagreeing ranks -----------------


def changes_job() -> dict[str, Any]:
    """7 steps: float32, from step 3 float64 by ``p.data = p.data.double()``, from step 5
    float32 again by ``model.float()`` (which swaps the parameters' contents); a backward
    that raises half-way at step 4; the parameters compared with one process's."""
    placement = _world()
    torch.manual_seed(0)
    reference = Net()
    model = copy.deepcopy(reference).to_global(placement, B)
    fail = {"now": False}

    def maybe_raise(grad: torch.Tensor) -> torch.Tensor:
        if fail["now"]:
            raise RuntimeError("stop here")
        return grad

    counts, raised = [], False
    for step in range(7):
        if step == 3:  # p.data = ...: the buckets are made again, for float64
            reference.double()
            for p in model.parameters():
                p.data = p.data.double()
        if step == 5:  # swapped for new parameters: found again
            reference.float()
            model.float()
        dtype = torch.float64 if step in (3, 4) else torch.float32
        x, y = (t.to(dtype) for t in _micro_batches(step, 1)[0])
        for m in (reference, model):
            for p in m.parameters():
                p.grad = None
        if step == 4:  # a backward that raises after the first bucket's gradients arrived
            gx, gy = _split_batch(placement, x, y)
            h = model.fc1(gx)
            h.register_hook(maybe_raise)
            fail["now"] = True
            try:
                F.mse_loss(model.fc2(F.relu(h)), gy).backward()
            except RuntimeError:
                raised = True
            fail["now"] = False
            for p in model.parameters():
                p.grad = None
        F.mse_loss(reference(x), y).backward()
        gx, gy = _split_batch(placement, x, y)
        events: list[str] = []
        with _recording_launches(events):
            F.mse_loss(model(gx), gy).backward()
        counts.append(len(events))
        with torch.no_grad():
            for p_ref, p in zip(reference.parameters(), model.parameters(), strict=True):
                if p_ref.grad is not None:
                    p_ref -= 0.1 * p_ref.grad
                    p -= 0.1 * p.grad
    dtypes = sorted({str(p.grad.dtype) for p in model.parameters() if p.grad is not None})
    return {
        "errors": _errors(_logical(model), reference),
        "counts": counts,
        "raised": raised,
        "dtypes": dtypes,
    }


def test_dtype_change_and_a_raising_backward_keep_it_exact() -> None:
    """A dtype change after the buckets were made (``p.data = ...``: they are made again; or
    ``module.float()``, which swaps in new parameters: discovered again), and a backward that
    raised half-way (the next one starts afresh): training equals one process, and each
    backward launches its bucket, the first one and the one after a swap included."""
    for got in get_pool(2).run(changes_job):
        assert got["raised"], got
        assert not got["errors"], got
        assert got["counts"] == [1, 1, 1, 1, 1, 1, 1], got["counts"]
        assert got["dtypes"] == ["torch.float32"], got


def bare_leaf_job() -> dict[str, Any]:
    """A bare global leaf (no nn.Parameter) trained by hand, and a leaf made anew each step."""
    placement = _world()
    w_full = torch.randn(6, 3, generator=torch.Generator().manual_seed(1))
    w = w_full.to_global(placement, B).requires_grad_()
    w_ref = w_full.clone().requires_grad_()
    counts, fresh_counts, errors = [], [], []
    for step in range(4):
        x, _ = _micro_batches(step, 1)[0]
        (gx,) = _split_batch(placement, x)
        w.grad, w_ref.grad = None, None
        events: list[str] = []
        with _recording_launches(events):
            (gx @ w).pow(2).sum().backward()
        (x @ w_ref).pow(2).sum().backward()
        counts.append(len(events))
        errors.append((w.grad.to_local() - w_ref.grad).abs().max().item())
        fresh = w_full.to_global(placement, B).requires_grad_()
        events = []
        with _recording_launches(events):
            (gx @ fresh).sum().backward()
        fresh_counts.append(len(events))
    return {"counts": counts, "fresh": fresh_counts, "errors": errors}


def test_bare_leaves_join_in_their_second_backward() -> None:
    """A bare global leaf joins the buckets in its second backward (per-parameter in its
    first), a leaf made anew each step never does; both get one process's gradients."""
    for got in get_pool(2).run(bare_leaf_job):
        assert got["counts"] == [0, 1, 1, 1], got
        assert got["fresh"] == [0, 0, 0, 0], got
        assert max(got["errors"]) < _TOL, got


def bare_leaf_records_job() -> dict[str, Any]:
    """What a bare leaf's backward passes leave on it, how a deep copy of a leaf seen once
    joins the buckets, and how many records leaves made anew each step leave behind."""
    from sbpflow import _global

    placement = _world()
    w_full = torch.randn(6, 3, generator=torch.Generator().manual_seed(2))
    w = w_full.to_global(placement, B).requires_grad_()
    keys_before = set(w.__dict__)
    x, _ = _micro_batches(0, 1)[0]
    (gx,) = _split_batch(placement, x)
    (gx @ w).pow(2).sum().backward()
    added = sorted(set(w.__dict__) - keys_before - {"_grad_hooks_dict"})
    # a copy of a leaf seen once is a new leaf: per-parameter first, buckets from its second
    copied = copy.deepcopy(w)
    ref = w_full.clone().requires_grad_()
    counts, errors = [], []
    for step in range(2):
        x, _ = _micro_batches(step, 1)[0]
        (gx,) = _split_batch(placement, x)
        copied.grad, ref.grad = None, None
        events: list[str] = []
        with _recording_launches(events):
            (gx @ copied).pow(2).sum().backward()
        (x @ ref).pow(2).sum().backward()
        counts.append(len(events))
        errors.append((copied.grad.to_local() - ref.grad).abs().max().item())
    sightings = getattr(_global._partial_gradients, "sightings", None)
    if sightings is None:  # the discovery keeps no records of its own
        return {"added": added, "counts": counts, "errors": errors, "grown": None}
    gc.collect()
    before = len(sightings)
    for _ in range(5):  # leaves made anew each step, dropped after their step
        fresh = w_full.to_global(placement, B).requires_grad_()
        (gx @ fresh).sum().backward()
        del fresh
    gc.collect()
    return {"added": added, "counts": counts, "errors": errors, "grown": len(sightings) - before}


def test_bare_leaves_keep_no_data_parallel_state() -> None:
    """The backward passes a bare leaf was seen in are counted by the data-parallel side, not
    in the tensor's ``__dict__``: the leaf gains no attribute, a deep copy of a leaf seen once
    starts afresh (per-parameter in its first backward, buckets from its second), both with
    one process's gradients, and dropped leaves leave no record behind."""
    for got in get_pool(2).run(bare_leaf_records_job):
        assert got["added"] == [], got
        assert got["counts"] == [0, 1], got
        assert max(got["errors"]) < _TOL, got
        assert got["grown"] == 0, got


def disagreeing_job() -> str:
    """Rank-dependent parameters handed to the order check (as a program whose ranks
    computed different gradients would): the error each rank raises."""
    placement = _world()
    shape = (3, 2) if sbpflow.env.get_rank() == 0 else (2, 3)
    w = sbpflow.GlobalTensor(torch.zeros(shape), Layout(placement, (B,)), shape)
    try:
        _check_same_order([GlobalParam("w", torch.nn.Parameter(w))])
    except RuntimeError as error:
        return str(error)
    return "no error"


def test_ranks_that_noted_different_parameters_raise_on_every_rank() -> None:
    """Bucket order is agreed once: ranks that saw different parameters all raise."""
    for message in get_pool(2).run(disagreeing_job):
        assert "different parameters, or in a different order" in message, message
        assert "[0, 1]" in message, message


# -- no_sync(module) ----------------------------------------------------------------------


def no_sync_misuse_job() -> str:
    try:
        with no_sync("model"):  # type: ignore[arg-type]
            pass
    except TypeError as error:
        return str(error)
    return "no error"


def test_no_sync_wants_a_module() -> None:
    """no_sync of something else than a module is a TypeError naming what it got."""
    for message in get_pool(2).run(no_sync_misuse_job):
        assert "nn.Module" in message and "str" in message, message


# -- a dropped model frees its buckets -------------------------------------------------------


def dropped_job() -> list[bool]:
    """Whether the GradientSync of a global model and of a DDP model is freed once the model
    (and, for DDP, the wrapper) is dropped after a few steps."""
    placement = _world()
    freed = []
    for kind in ("global", "ddp"):
        module = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 4))
        if kind == "global":
            model: nn.Module = module.to_global(placement, B)
            (x,) = _split_batch(placement, torch.randn(8, 64))
        else:
            model = DistributedDataParallel(module)
            x = torch.randn(4, 64)
        for _ in range(3):
            model.zero_grad()
            model(x).sum().backward()
        sync = GradientSync.of(model[0].weight) if kind == "global" else model._sync
        alive = weakref.ref(sync)
        del model, module, x, sync
        gc.collect()
        freed.append(alive() is None)
    return freed


def test_a_dropped_model_frees_its_buckets() -> None:
    """The buckets (flat buffers the size of the model) go with the model: nothing keeps a
    GradientSync alive once its global parameters, or its DDP wrapper, are gone."""
    for freed in get_pool(2).run(dropped_job):
        assert freed == [True, True], freed


def deepcopy_job() -> dict[str, Any]:
    """A model trained 2 steps, then deep-copied; both trained 3 more steps on the same
    batches: the bucket launches of each backward and the parameters of both."""
    placement = _world()
    torch.manual_seed(0)
    reference = Net()
    model = copy.deepcopy(reference).to_global(placement, B)
    copied: nn.Module | None = None
    launches: dict[str, list[int]] = {"model": [], "copy": []}
    for step in range(5):
        x, y = _micro_batches(step, 1)[0]
        if step == 2:
            copied = copy.deepcopy(model)
        F.mse_loss(reference(x), y).backward()
        gx, gy = _split_batch(placement, x, y)
        for name, m in (("model", model), ("copy", copied)):
            if m is None:
                continue
            events: list[str] = []
            with _recording_launches(events):
                F.mse_loss(m(gx), gy).backward()
            launches[name].append(len(events))
        with torch.no_grad():
            for m in (reference, model, copied):
                if m is None:
                    continue
                for p in m.parameters():
                    if p.grad is not None:
                        p -= 0.1 * p.grad
                        p.grad = None
    assert copied is not None
    return {
        "errors": [_errors(_logical(model), reference), _errors(_logical(copied), reference)],
        "launches": launches,
    }


def test_a_deep_copy_gets_buckets_of_its_own() -> None:
    """copy.deepcopy of a model whose gradients are in buckets: the copy's parameters join
    buckets of their own (from their first backward), the original keeps its own, and both
    train as one process does."""
    for got in get_pool(2).run(deepcopy_job):
        assert got["errors"] == [{}, {}], got
        assert got["launches"] == {"model": [1, 1, 1, 1, 1], "copy": [1, 1, 1]}, got


# -- how a gradient reaches its bucket ------------------------------------------------------


def hand_over_job() -> dict[str, Any]:
    """3 steps of ``Net``: a post-accumulate-grad hook of the user's on ``fc2.weight`` from
    the start (it runs before the buckets' own), a gradient hook on ``fc1.weight`` from step 2
    (after the buckets' own); the ``aten.detach`` calls the AccumulateGrad nodes of each
    backward send through the global dispatcher, counted from outside, and the gradients
    against one process's."""
    placement = _world()
    torch.manual_seed(0)
    reference = Net()
    model = copy.deepcopy(reference).to_global(placement, B)
    seen: list[str] = []
    model.fc2.weight.register_post_accumulate_grad_hook(
        lambda p: seen.append(f"post {type(p.grad).__name__}")
    )
    dispatcher = sbpflow.GlobalTensor._op_dispatcher
    inner = dispatcher.dispatch
    detaches = [0]

    def counted(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        node = torch._C._current_autograd_node()
        if func is torch.ops.aten.detach.default and type(node).__name__ == "AccumulateGrad":
            detaches[0] += 1
        return inner(func, args, kwargs)

    out: dict[str, Any] = {"detaches": [], "errors": [], "seen": []}
    for step in range(3):
        x, y = _micro_batches(step, 1)[0]
        reference.zero_grad()
        model.zero_grad()
        F.mse_loss(reference(x), y).backward()
        if step == 2:
            model.fc1.weight.register_hook(lambda g: seen.append(f"pre {type(g).__name__}"))
        gx, gy = _split_batch(placement, x, y)
        loss = F.mse_loss(model(gx), gy)
        seen.clear()
        detaches[0] = 0
        dispatcher.dispatch = counted  # type: ignore[method-assign]
        try:
            loss.backward()
        finally:
            del dispatcher.dispatch
        out["detaches"].append(detaches[0])
        out["seen"].append(sorted(seen))
        out["errors"].append(_grad_errors(model, reference))
    return out


def _grad_errors(model: nn.Module, reference: nn.Module) -> dict[str, Any]:
    """The parameters whose gradient differs from the reference's (None where one is None)."""
    out: dict[str, Any] = {}
    for name, ref in reference.named_parameters():
        grad = model.get_parameter(name).grad
        if grad is None or ref.grad is None:
            if grad is not None or ref.grad is not None:
                out[name] = None
            continue
        error = (grad.to_global(sbp=B).to_local() - ref.grad).abs().max().item()
        if error > _TOL:
            out[name] = error
    return out


def test_gradients_reach_their_buckets_without_a_detach_per_parameter() -> None:
    """Once the buckets are made, a parameter's gradient goes into its bucket without
    AccumulateGrad detaching it through the global dispatcher (one op a parameter and step):
    none is sent but for the parameters with a hook of the user's that would see the
    gradient after the buckets' own hook (``fc2.weight`` from the start, ``fc1.weight`` from
    step 2), and those hooks still see global gradients. Gradients equal one process's."""
    for got in get_pool(2).run(hand_over_job):
        assert got["errors"] == [{}, {}, {}], got
        assert got["detaches"][1:] == [1, 2], got
        assert got["seen"][1:] == [
            ["post GlobalTensor"],
            ["post GlobalTensor", "pre GlobalTensor"],
        ], got


# -- module conversions (swapped parameters) -----------------------------------------------


def converted_job(conversion: str) -> dict[str, Any]:
    """``model.to_global`` then a conversion that swaps the parameters' contents
    (``Module._apply``), then 3 steps, a hook of the user's added after the conversion doubling
    ``fc2.weight``'s gradient: gradients, hook calls and the gradients' types."""
    convert = {"to('cpu')": lambda m: m.to("cpu"), "double()": lambda m: m.double()}[conversion]
    placement = _world()
    torch.manual_seed(0)
    reference = Net()
    model = copy.deepcopy(reference).to_global(placement, B)
    convert(reference)
    convert(model)
    calls: list[str] = []
    for m in (reference, model):
        m.fc2.weight.register_hook(lambda g: g * 2)
        m.fc2.bias.register_post_accumulate_grad_hook(lambda p: calls.append(type(p.grad).__name__))
    dtype = reference.fc1.weight.dtype
    errors, types = [], []
    for step in range(3):
        x, y = (t.to(dtype) for t in _micro_batches(step, 1)[0])
        gx, gy = _split_batch(placement, x, y)
        reference.zero_grad()
        model.zero_grad()
        F.mse_loss(reference(x), y).backward()
        F.mse_loss(model(gx), gy).backward()
        errors.append(_grad_errors(model, reference))
        types.append(
            sorted({type(p.grad).__name__ for p in model.parameters() if p.grad is not None})
        )
    return {"errors": errors, "types": types, "calls": calls}


@pytest.mark.parametrize("conversion", ["to('cpu')", "double()"])
def test_a_module_conversion_before_the_first_backward_trains_as_one_process(
    conversion: str,
) -> None:
    """``model.to(...)`` swaps a global parameter's contents (NOTE [hook dicts after a swap]):
    the buckets' hooks and hooks the user adds afterwards still run, every gradient is global
    and equals one process's (a gradient hook doubling one of them included)."""
    for got in get_pool(2).run(converted_job, conversion):
        assert got["errors"] == [{}, {}, {}], got
        assert got["types"] == [["GlobalTensor"]] * 3, got
        assert got["calls"] == ["Tensor", "GlobalTensor"] * 3, got
