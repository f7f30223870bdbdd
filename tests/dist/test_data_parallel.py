"""Bucketed gradient sync (a global model's default buckets, ``sync_gradients``) and
``DistributedDataParallel`` against single-process training computed in the same job.

The model has a parameter its forward never uses (``unused``): its gradient must stay
None, as in the single-process reference, so AdamW leaves it alone. Every run trains 5
steps of SGD-momentum and of AdamW; a step is one batch or 4 micro-batches accumulated
with ``no_sync()`` (the reference accumulates the same micro-batches in one process).
Global data parallelism runs on 2 and 4 ranks and as DP x TP on a 2x2 mesh (axis 0 data,
axis 1 a column- then row-parallel Linear), with nothing to call (the default buckets,
``no_sync(model)`` to accumulate) and with ``sync_gradients``; DDP keeps local tensors, each rank a slice of
the batch. Losses of a step are means over the whole (micro-)batch, so the summed or
averaged gradients equal the reference's. Bucket launches are traced: how many
all_reduces ran in each backward, and (overlap) that the first bucket is launched before
backward has computed the last gradient.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

import sbpflow
from sbpflow.comm import collectives
from sbpflow.nn.parallel import DistributedDataParallel, no_sync, sync_gradients
from sbpflow.sbp import Broadcast, Partial, Split, sbp_str
from sbpflow.testing import get_pool

S0, S1, B, P = Split(0), Split(1), Broadcast(), Partial("sum")
_STEPS = 5
_TOL = 1e-5
_SMALL_CAP_MB = 1e-4  # 104 bytes: buckets [fc2.bias, fc2.weight], [unused.*], [fc1.*]
_UNUSED = {"unused.weight", "unused.bias"}


class Net(nn.Module):
    """``fc1`` column-parallel, ``fc2`` row-parallel under TP; ``unused`` is never called."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(6, 8)
        self.unused = nn.Linear(8, 8)
        self.fc2 = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.relu(self.fc1(x)))


_OPTIMIZERS: dict[str, Callable[..., torch.optim.Optimizer]] = {
    "sgd": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
    "adamw": lambda params: torch.optim.AdamW(params, lr=0.01),
}


def _micro_batches(step: int, count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``count`` logical micro-batches of 8 samples (the same on every rank)."""
    gen = torch.Generator().manual_seed(100 + step)
    return [
        (torch.randn(8, 6, generator=gen), torch.randn(8, 3, generator=gen)) for _ in range(count)
    ]


def _reference_step(
    model: nn.Module, opt: torch.optim.Optimizer, batches: list[tuple[torch.Tensor, torch.Tensor]]
) -> None:
    opt.zero_grad()
    for x, y in batches:
        F.mse_loss(model(x), y).backward()
    opt.step()


def _errors(got: dict[str, torch.Tensor], want: nn.Module) -> dict[str, float]:
    """Max abs difference per parameter that differs beyond the tolerance."""
    out = {}
    for name, ref in want.named_parameters():
        value = got[name].double()
        if not torch.allclose(value, ref.detach().double(), atol=_TOL, rtol=_TOL):
            out[name] = (value - ref.detach().double()).abs().max().item()
    return out


@contextlib.contextmanager
def _recording_launches(events: list[str]) -> Any:
    """Append ``launch <numel> over <ranks>`` to ``events`` for every bucket launched."""
    original = collectives.all_reduce_async

    def launch(tensor: torch.Tensor, group: Any, op: str) -> Any:
        events.append(f"launch {tensor.numel()} over {list(group[0])}")
        return original(tensor, group, op)

    collectives.all_reduce_async = launch  # type: ignore[assignment]
    try:
        yield
    finally:
        collectives.all_reduce_async = original  # type: ignore[assignment]


# -- global data parallelism ------------------------------------------------------------


def _megatron(name: str, t: torch.Tensor) -> Any:
    module, kind = name.rsplit(".", 1)
    if module == "fc1":
        return (B, S0)
    if module == "fc2" and kind == "weight":
        return (B, S1)
    return (B, B)


def _train_global(
    placement: sbpflow.Placement,
    param_sbp: Any,
    batch_sbp: Any,
    optimizer: str,
    num_micro: int,
    synced: bool,
) -> dict[str, Any]:
    """``synced``: with ``sync_gradients`` (small buckets); else the default buckets."""
    torch.manual_seed(0)
    reference = Net()
    full = (B,) * placement.ndim
    model = copy.deepcopy(reference).to_global(placement, full).to_global(placement, param_sbp)
    if synced:
        sync = sync_gradients(model, bucket_cap_mb=_SMALL_CAP_MB)
        pause, buckets = sync.no_sync, sync.buckets
    else:
        pause, buckets = (lambda: no_sync(model)), None
    opt_ref, opt = (
        _OPTIMIZERS[optimizer](reference.parameters()),
        _OPTIMIZERS[optimizer](model.parameters()),
    )
    reduce_counts, accumulating_sbps, grad_sbps, unused_grads = [], set(), {}, []
    launches: list[str] = []
    tensor_axis_reduces: list[int] = []
    row_bias_sbps: set[str] = set()
    for step in range(_STEPS):
        batches = _micro_batches(step, num_micro)
        _reference_step(reference, opt_ref, batches)
        opt.zero_grad()
        for i, (x, y) in enumerate(batches):
            gx = x.to_global(placement, full).to_global(sbp=batch_sbp)
            gy = y.to_global(placement, full).to_global(sbp=batch_sbp)
            last = i == num_micro - 1
            with (
                contextlib.nullcontext() if last else pause(),
                sbpflow.boxing.trace() as t,
                _recording_launches(launches),
            ):
                F.mse_loss(model(gx), gy).backward()
            # On the data axis (0): the gradients' reductions, not the all_reduce of
            # Megatron's row-parallel output (axis 1 of a 2x2 mesh, in forward)
            reduce_counts.append(t.collectives_by_axes()[("all_reduce", (0,))])
            tensor_axis_reduces.append(t.collectives_by_axes()[("all_reduce", (1,))])
            if not last:
                accumulating_sbps.add(sbp_str(model.fc1.bias.grad.sbp))
                row_bias_sbps.add(sbp_str(model.fc2.bias.grad.sbp))
        grad_sbps = {
            n: (sbp_str(p.grad.sbp), sbp_str(p.sbp))
            for n, p in model.named_parameters()
            if p.grad is not None
        }
        unused_grads.append([model.get_parameter(n).grad is None for n in sorted(_UNUSED)])
        opt.step()
    logical = {
        n: p.to_global(sbp=full, check_meta=False).to_local().detach()
        for n, p in model.named_parameters()
    }
    return {
        "errors": _errors(logical, reference),
        "reduce_counts": reduce_counts,
        "accumulating_sbps": sorted(accumulating_sbps),
        "grad_sbps": grad_sbps,
        "unused_grads_none": unused_grads,
        "buckets": buckets,
        "launch_groups": sorted({e.split(" over ")[1] for e in launches}),
        "row_bias_sbps": sorted(row_bias_sbps),
        "tensor_axis_reduces": tensor_axis_reduces,
    }


def global_data_parallel_job(synced: bool) -> list[tuple[str, dict[str, Any]]]:
    world = sbpflow.placement("cpu", list(range(sbpflow.env.get_world_size())))
    return [
        (f"{opt} micro={n}", _train_global(world, B, S0, opt, n, synced))
        for opt in _OPTIMIZERS
        for n in (1, 4)
    ]


def global_mesh_job(synced: bool) -> list[tuple[str, dict[str, Any]]]:
    mesh = sbpflow.placement("cpu", [[0, 1], [2, 3]])
    return [
        (f"2x2 {opt} micro={n}", _train_global(mesh, _megatron, (S0, B), opt, n, synced))
        for opt in _OPTIMIZERS
        for n in (1, 4)
    ]


def _default_reduce_counts(got: dict[str, Any], num_micro: int, per_backward: int) -> None:
    """The default path: the first backward (the first micro-batch's) finds the parameters
    and makes the buckets; ``per_backward`` all_reduces (one per bucket) in each synced
    backward, the first one included, and none while accumulating (a first backward inside
    no_sync() reduces nothing until the block ends)."""
    counts = got["reduce_counts"]
    assert counts == ([0] * (num_micro - 1) + [per_backward]) * _STEPS, counts


def _check_values(results: list[list[tuple[str, dict[str, Any]]]]) -> None:
    for rank, per_rank in enumerate(results):
        for label, got in per_rank:
            where = f"rank {rank}, {label}"
            assert not got["errors"], f"{where}: parameters differ from the reference: {got}"
            assert all(all(flags) for flags in got["unused_grads_none"]), f"{where}: {got}"
            assert not set(got["grad_sbps"]) & _UNUSED, f"{where}: {got['grad_sbps']}"
            for name, (grad_sbp, param_sbp) in got["grad_sbps"].items():
                assert grad_sbp == param_sbp, f"{where}: {name}.grad {grad_sbp}, param {param_sbp}"


@pytest.mark.parametrize("synced", [False, True], ids=["default", "sync_gradients"])
@pytest.mark.parametrize("world_size", [2, 4])
def test_global_data_parallel_matches_single_process(world_size: int, synced: bool) -> None:
    """Broadcast parameters, S(0) batch, the default buckets or sync_gradients' buckets of
    ~100 bytes: SGD and AdamW, one batch or 4 no_sync micro-batches per step, equal
    single-process training on the whole batch."""
    results = get_pool(world_size).run(global_data_parallel_job, synced)
    _check_values(results)
    for per_rank in results:
        for label, got in per_rank:
            num_micro = 4 if label.endswith("micro=4") else 1
            assert got["launch_groups"] == [str(list(range(len(results))))], (label, got)
            if num_micro > 1:  # gradients stay partial sums while accumulating
                assert got["accumulating_sbps"] == ["P"], (label, got)
            if not synced:  # one bucket (of 25 MB): the unused parameters never join
                _default_reduce_counts(got, num_micro, 1)
                continue
            assert got["buckets"] == [
                ["fc2.bias", "fc2.weight"],
                ["unused.bias", "unused.weight"],
                ["fc1.bias", "fc1.weight"],
            ], got["buckets"]
            # One all_reduce per bucket with a gradient (the unused one has none), in the
            # last micro-batch's backward only; none from the per-parameter path.
            assert got["reduce_counts"] == ([0] * (num_micro - 1) + [2]) * _STEPS, (label, got)


@pytest.mark.parametrize("synced", [False, True], ids=["default", "sync_gradients"])
def test_global_data_and_tensor_parallel_on_2x2_mesh(synced: bool) -> None:
    """Parameters (B, S(k)) and a (S(0), B) batch on a 2x2 mesh, buckets reducing over the
    data axis (the default ones or sync_gradients'): equal single-process training;
    gradients arrive in the parameters' layouts; every bucket all_reduce runs over the data
    axis' groups, except the one of a parameter broadcast on both axes."""
    results = get_pool(4).run(global_mesh_job, synced)
    _check_values(results)
    for rank, per_rank in enumerate(results):
        for label, got in per_rank:
            assert got["grad_sbps"]["fc1.weight"] == ("(B, S(0))", "(B, S(0))"), (label, got)
            assert got["grad_sbps"]["fc2.weight"] == ("(B, S(1))", "(B, S(1))"), (label, got)
            if label.endswith("micro=4"):  # partial on the data axis while accumulating
                assert got["accumulating_sbps"] == ["(P, S(0))"], (label, got)
            # Buckets reduce over the data axis only (groups of 2 ranks along axis 0): the
            # row-parallel output is reduced on axis 1 in forward (Megatron's all_reduce), so
            # the gradient of fc2.bias (B, B), added after it, arrives (P, B).
            data_group = "[0, 2]" if rank in (0, 2) else "[1, 3]"
            assert got["launch_groups"] == [data_group], (label, got)
            if label.endswith("micro=4"):
                assert got["row_bias_sbps"] == ["(P, B)"], (label, got)
            # One all_reduce on the tensor axis per forward (of each micro-batch): Megatron's.
            assert got["tensor_axis_reduces"] == [1] * len(got["reduce_counts"]), (label, got)
            if not synced:
                # Two default buckets, both reduced over the data axis: parameters of one
                # kind (placement, data axes, dtype) share a bucket (NOTE [bucket order]), and
                # fc2.bias (B, B) has data axes (0, 1), the others (B, S(k)) only (0,). The
                # kind comes from the parameter's layout, not from one backward's gradients:
                # had its gradient arrived (P, P), its bucket would reduce over both axes.
                _default_reduce_counts(got, 4 if label.endswith("micro=4") else 1, 2)


# -- DistributedDataParallel ------------------------------------------------------------


def _train_ddp(placement: sbpflow.Placement, optimizer: str, num_micro: int) -> dict[str, Any]:
    rank = sbpflow.env.get_rank()
    torch.manual_seed(0)
    reference = Net()
    local = copy.deepcopy(reference)
    with torch.no_grad():  # wrapping must broadcast the first rank's parameters
        for p in local.parameters():
            p.add_(float(placement.flat_ranks.index(rank)))
    ddp = DistributedDataParallel(local, bucket_cap_mb=_SMALL_CAP_MB, placement=placement)
    opt_ref, opt = (
        _OPTIMIZERS[optimizer](reference.parameters()),
        _OPTIMIZERS[optimizer](ddp.parameters()),
    )
    index = placement.flat_ranks.index(rank)
    reduce_counts, unused_grads = [], []
    for step in range(_STEPS):
        batches = _micro_batches(step, num_micro)
        _reference_step(reference, opt_ref, batches)
        opt.zero_grad()
        for i, (x, y) in enumerate(batches):
            lx = torch.tensor_split(x, placement.num_ranks)[index]
            ly = torch.tensor_split(y, placement.num_ranks)[index]
            last = i == num_micro - 1
            with contextlib.nullcontext() if last else ddp.no_sync(), sbpflow.boxing.trace() as t:
                F.mse_loss(ddp(lx), ly).backward()
            reduce_counts.append(t.collectives()["all_reduce"])
        unused_grads.append([ddp.module.get_parameter(n).grad is None for n in sorted(_UNUSED)])
        opt.step()
    got = {n: p.detach() for n, p in ddp.module.named_parameters()}
    return {
        "errors": _errors(got, reference),
        "reduce_counts": reduce_counts,
        "unused_grads_none": unused_grads,
        "grad_sbps": {},
    }


def ddp_job() -> list[tuple[str, dict[str, Any]]]:
    world = sbpflow.env.get_world_size()
    placements = [sbpflow.placement("cpu", list(range(world)))]
    if world == 4:
        placements.append(sbpflow.placement("cpu", [[0, 1], [2, 3]]))
    return [
        (f"{pl} {opt} micro={n}", _train_ddp(pl, opt, n))
        for pl in placements
        for opt in _OPTIMIZERS
        for n in (1, 4)
    ]


@pytest.mark.parametrize("world_size", [2, 4])
def test_ddp_matches_single_process(world_size: int) -> None:
    """Local models (different initial values per rank, the first rank's broadcast at wrap),
    each rank a slice of the batch: SGD and AdamW with and without no_sync accumulation
    equal single-process training on the whole batch (on 4 ranks also over a 2x2 mesh)."""
    results = get_pool(world_size).run(ddp_job)
    _check_values(results)
    for per_rank in results:
        for label, got in per_rank:
            num_micro = 4 if label.endswith("micro=4") else 1
            # Local gradients are always partial: every bucket is reduced, the unused one too.
            assert got["reduce_counts"] == ([0] * (num_micro - 1) + [3]) * _STEPS, (label, got)


# -- parameters used in some micro-batches or on some ranks only ---------------------------


class Branchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 3)
        self.extra = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor, use_extra: bool) -> torch.Tensor:
        out = self.fc(x)
        return out + self.extra(x) if use_extra else out


def _branchy_reference(
    model: nn.Module, x: torch.Tensor, uses: list[bool], num_ranks: int
) -> torch.Tensor:
    """The output when rank ``k``'s slice of the batch goes through ``extra`` iff ``uses[k]``."""
    pieces = torch.tensor_split(x, num_ranks)
    return torch.cat([model(piece, use) for piece, use in zip(pieces, uses, strict=True)])


def partial_use_job() -> dict[str, dict[str, float]]:
    """Max parameter error against the reference for each way ``extra`` is left out."""
    world = sbpflow.env.get_world_size()
    rank = sbpflow.env.get_rank()
    placement = sbpflow.placement("cpu", list(range(world)))
    out = {}
    # (name, global or DDP, micro-batches, uses[micro][rank])
    plans = [
        (
            "global, extra in the first 2 of 4 micro-batches",
            True,
            [[i < 2] * world for i in range(4)],
        ),
        (
            "global default buckets, extra in the first 2 of 4 micro-batches",
            True,
            [[i < 2] * world for i in range(4)],
        ),
        (
            "ddp, extra in the first 2 of 4 micro-batches",
            False,
            [[i < 2] * world for i in range(4)],
        ),
        ("ddp, extra on rank 0 only", False, [[r == 0 for r in range(world)]]),
    ]
    for label, is_global, uses in plans:
        torch.manual_seed(0)
        reference = Branchy()
        model: nn.Module = copy.deepcopy(reference)
        if is_global and "default" in label:
            model = model.to_global(placement, B)
            pause: Callable[[], Any] = lambda model=model: no_sync(model)  # noqa: E731
        elif is_global:
            model = model.to_global(placement, B)
            pause = sync_gradients(model, bucket_cap_mb=_SMALL_CAP_MB).no_sync
        else:
            model = DistributedDataParallel(model, bucket_cap_mb=_SMALL_CAP_MB)
            pause = model.no_sync
        opt_ref = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        for step in range(2):
            batches = _micro_batches(step, len(uses))
            opt_ref.zero_grad()
            for (x, y), use in zip(batches, uses, strict=True):
                F.mse_loss(_branchy_reference(reference, x, use, world), y).backward()
            opt_ref.step()
            opt.zero_grad()
            for i, ((x, y), use) in enumerate(zip(batches, uses, strict=True)):
                with contextlib.nullcontext() if i == len(uses) - 1 else pause():
                    if is_global:
                        gx, gy = x.to_global(placement, B), y.to_global(placement, B)
                        gx, gy = gx.to_global(sbp=S0), gy.to_global(sbp=S0)
                        F.mse_loss(model(gx, use[0]), gy).backward()
                    else:
                        lx, ly = (
                            torch.tensor_split(x, world)[rank],
                            torch.tensor_split(y, world)[rank],
                        )
                        F.mse_loss(model(lx, use[rank]), ly).backward()
            opt.step()
        if is_global:
            got = {n: p.to_global(sbp=B).to_local().detach() for n, p in model.named_parameters()}
        else:
            got = {n.removeprefix("module."): p.detach() for n, p in model.named_parameters()}
        out[label] = _errors(got, reference)
    return out


def test_parameters_used_in_some_micro_batches_or_ranks_only() -> None:
    """A branch used only in early micro-batches (global DP, default buckets or synced, and
    DDP) has its accumulated gradient reduced at the end; a branch used on one rank only
    (DDP) gets the mean of that rank's gradient and zeros: both equal single-process
    training, computed in the job."""
    for per_rank in get_pool(2).run(partial_use_job):
        assert per_rank and all(not errors for errors in per_rank.values()), per_rank


# -- overlap, attribute pass-through, errors ------------------------------------------------


class Deep(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(*[nn.Linear(16, 16) for _ in range(4)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


def _backward_events(kind: str) -> list[str]:
    """Events of one backward: a gradient computed (tensor hook) or a bucket launched."""
    placement = sbpflow.placement("cpu", list(range(sbpflow.env.get_world_size())))
    events: list[str] = []
    x = torch.randn(4, 16)
    if kind == "global":
        model: nn.Module = Deep().to_global(placement, B)
        sync_gradients(model, bucket_cap_mb=1e-6)  # one bucket per parameter
        x = x.to_global(placement, S0)
    else:
        model = DistributedDataParallel(Deep(), bucket_cap_mb=1e-6)
    for name, p in model.named_parameters():
        short = name.removeprefix("module.")
        p.register_hook(lambda g, short=short: events.append(f"grad {short}"))
    with _recording_launches(events):
        model(x).pow(2).sum().backward()  # gradients arrive partial (biases too)
    return events


def overlap_job() -> dict[str, list[str]]:
    torch.manual_seed(0)
    return {kind: _backward_events(kind) for kind in ("global", "ddp")}


def test_bucket_launches_overlap_backward() -> None:
    """With one bucket per parameter, the last layer's bucket is launched while backward is
    still computing earlier layers' gradients, for global DP and for DDP."""
    for per_rank in get_pool(2).run(overlap_job):
        for kind, events in per_rank.items():
            launches = [i for i, e in enumerate(events) if e.startswith("launch")]
            grads = [i for i, e in enumerate(events) if e.startswith("grad")]
            assert len(launches) == 8 and len(grads) == 8, (kind, events)
            assert launches[0] < grads[-1], (kind, events)
            assert events[grads[0]].startswith("grad layers.3."), (kind, events)
            assert events[grads[-1]].startswith("grad layers.0."), (kind, events)
            # every bucket but the first layer's last one is launched before the last gradient
            assert sum(i < grads[-1] for i in launches) >= 6, (kind, events)


def _torch_ddp_buckets(module: nn.Module, bucket_cap_mb: float | None) -> list[list[str]]:
    """The parameter names of each bucket torch DDP reduces once it has rebuilt its buckets
    (after the first backward), in the order its comm hook sees them."""
    ddp = nn.parallel.DistributedDataParallel(module, bucket_cap_mb=bucket_cap_mb)
    names = {id(p): n for n, p in module.named_parameters()}
    seen: list[list[str]] = []

    def hook(state, bucket):  # type: ignore[no-untyped-def]  # torch reads the annotations
        seen.append(sorted(names[id(p)] for p in bucket.parameters()))
        return allreduce_hook(state, bucket)

    ddp.register_comm_hook(None, hook)
    x = torch.randn(2, 512)
    for _ in range(2):
        seen.clear()
        ddp(x).sum().backward()
    return seen


def bucket_sizes_job() -> dict[str, list[list[list[str]]]]:
    """sbpflow's buckets next to torch DDP's, for the default and two given caps."""
    placement = sbpflow.placement("cpu", list(range(sbpflow.env.get_world_size())))
    out = {}
    for cap in (None, 25, 1.5):
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Linear(512, 512) for _ in range(3)])  # 1 MiB weights
        ours = DistributedDataParallel(copy.deepcopy(model), bucket_cap_mb=cap).buckets
        synced = sync_gradients(copy.deepcopy(model).to_global(placement, B), bucket_cap_mb=cap)
        out[str(cap)] = [
            [sorted(b) for b in ours],
            [sorted(b) for b in synced.buckets],
            _torch_ddp_buckets(copy.deepcopy(model), cap),
        ]
    return out


def test_bucket_sizes_follow_torch_ddp() -> None:
    """Left at its default, bucket_cap_mb gives a 1 MiB first bucket; a cap given applies to
    every bucket: the buckets are torch DDP's in both cases (checked against torch DDP)."""
    for per_rank in get_pool(2).run(bucket_sizes_job):
        for cap, (ddp, synced, torch_ddp) in per_rank.items():
            assert ddp == synced == torch_ddp, (cap, ddp, synced, torch_ddp)
        first, *_ = per_rank["None"][0]
        assert first == ["2.bias", "2.weight"], per_rank["None"]  # 1 MiB and a bias
        assert len(per_rank["25"][0]) == 1, per_rank["25"]  # 3 MiB: all in one bucket
        assert len(per_rank["1.5"][0]) == 2, per_rank["1.5"]  # [2.*, 1.*], [0.*]


class WithAttributes(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(2, 1))
        self.lr = 0.01

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.w


def misuse_job() -> list[str]:
    """The messages of each misuse (TypeError/ValueError), and attribute pass-through."""
    world = sbpflow.env.get_world_size()
    placement = sbpflow.placement("cpu", list(range(world)))
    ddp = DistributedDataParallel(WithAttributes())
    assert ddp.lr == 0.01 and isinstance(ddp.module, WithAttributes) and ddp.w is ddp.module.w
    messages = []
    cases: list[Callable[[], Any]] = [
        lambda: sync_gradients(WithAttributes()),
        lambda: sync_gradients(WithAttributes().to_global(placement, B), bucket_cap_mb=0),
        lambda: DistributedDataParallel(WithAttributes().to_global(placement, B)),
        lambda: DistributedDataParallel(WithAttributes(), bucket_cap_mb="25"),
    ]
    for case in cases:
        try:
            case()
        except (TypeError, ValueError) as error:
            messages.append(f"{type(error).__name__}: {error}")
        else:
            messages.append("no error")
    model = WithAttributes().to_global(placement, B)
    sync_gradients(model)
    try:
        sync_gradients(model)
    except ValueError as error:
        messages.append(f"ValueError: {error}")
    return messages


def test_misuse_is_a_clear_error() -> None:
    """Local modules to sync_gradients, global ones to DDP, bad bucket sizes, syncing twice."""
    for messages in get_pool(2).run(misuse_job):
        assert messages[0].startswith("TypeError") and "DistributedDataParallel" in messages[0]
        assert messages[1].startswith("ValueError") and "bucket_cap_mb" in messages[1]
        assert messages[2].startswith("TypeError") and "sync_gradients" in messages[2]
        assert messages[3].startswith("TypeError") and "'25'" in messages[3]
        assert messages[4].startswith("ValueError") and "already synced" in messages[4]


# -- gradients are views into the bucket buffers -------------------------------------------


def _local_grad(p: torch.Tensor) -> torch.Tensor:
    return p.grad.to_local() if isinstance(p.grad, sbpflow.GlobalTensor) else p.grad


def _train_zeroing(is_global: bool, set_to_none: bool | None, num_micro: int) -> dict[str, Any]:
    """4 SGD-momentum steps, ``zero_grad(set_to_none=...)`` before each (None: never zeroed,
    gradients accumulate over steps in the reference too)."""
    world = sbpflow.env.get_world_size()
    rank = sbpflow.env.get_rank()
    placement = sbpflow.placement("cpu", list(range(world)))
    torch.manual_seed(0)
    reference = Net()
    model: nn.Module
    if is_global:
        model = copy.deepcopy(reference).to_global(placement, B)
        sync = sync_gradients(model, bucket_cap_mb=_SMALL_CAP_MB)
        no_sync, buckets, params = sync.no_sync, sync.buckets, dict(model.named_parameters())
    else:
        model = DistributedDataParallel(copy.deepcopy(reference), bucket_cap_mb=_SMALL_CAP_MB)
        no_sync, buckets = model.no_sync, model.buckets
        params = dict(model.module.named_parameters())
    opt_ref = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    storages: dict[str, set[int]] = {name: set() for name in params}
    reduce_counts, accumulating_sbps = [], set()
    for step in range(4):
        batches = _micro_batches(step, num_micro)
        if set_to_none is not None:
            opt_ref.zero_grad(set_to_none=set_to_none)
            opt.zero_grad(set_to_none=set_to_none)
        for x, y in batches:
            F.mse_loss(reference(x), y).backward()
        opt_ref.step()
        for i, (x, y) in enumerate(batches):
            last = i == num_micro - 1
            with contextlib.nullcontext() if last else no_sync(), sbpflow.boxing.trace() as t:
                if is_global:
                    gx = x.to_global(placement, B).to_global(sbp=S0)
                    gy = y.to_global(placement, B).to_global(sbp=S0)
                    F.mse_loss(model(gx), gy).backward()
                else:
                    lx, ly = torch.tensor_split(x, world)[rank], torch.tensor_split(y, world)[rank]
                    F.mse_loss(model(lx), ly).backward()
            reduce_counts.append(t.collectives()["all_reduce"])
            if is_global and not last:
                accumulating_sbps.add(sbp_str(params["fc1.weight"].grad.sbp))
        for name, p in params.items():
            if p.grad is not None:
                storages[name].add(_local_grad(p).untyped_storage().data_ptr())
        opt.step()
    if is_global:
        got = {n: p.to_global(sbp=B).to_local().detach() for n, p in params.items()}
    else:
        got = {n: p.detach() for n, p in params.items()}
    return {
        "errors": _errors(got, reference),
        "buckets": buckets,
        "storages": {n: sorted(s) for n, s in storages.items()},
        "reduce_counts": reduce_counts,
        "accumulating_sbps": sorted(accumulating_sbps),
        "unused_grads_none": [params[n].grad is None for n in sorted(_UNUSED)],
    }


def bucket_view_job() -> list[tuple[str, dict[str, Any]]]:
    return [
        (f"{'global' if g else 'ddp'} set_to_none={z} micro={n}", _train_zeroing(g, z, n))
        for g in (True, False)
        for z in (True, False, None)
        for n in (1, 3)
    ]


def test_gradients_are_bucket_views_and_survive_zero_grad() -> None:
    """Global DP and DDP with zero_grad(set_to_none=True), zero_grad(set_to_none=False) and
    no zero_grad at all (gradients accumulating over steps), one batch or 3 no_sync
    micro-batches: parameters equal single-process training computed in the job with the
    same zeroing; every used parameter's .grad is a view into its bucket's one buffer, the
    same memory every step; one all_reduce per bucket, none while accumulating (a global
    .grad in the bucket is relabelled P in place, not boxed P -> B by the add)."""
    for per_rank in get_pool(2).run(bucket_view_job):
        for label, got in per_rank:
            assert not got["errors"], (label, got)
            storages = got["storages"]
            for bucket in got["buckets"]:
                used = [name for name in bucket if storages[name]]
                assert all(len(storages[name]) == 1 for name in used), (label, storages)
                assert len({storages[name][0] for name in used}) <= 1, (label, bucket, storages)
            assert len({s[0] for s in storages.values() if s}) == 2, (label, storages)
            num_micro = 3 if label.endswith("micro=3") else 1
            per_backward = 2 if label.startswith("global") else 3
            assert got["reduce_counts"] == ([0] * (num_micro - 1) + [per_backward]) * 4, (
                label,
                got["reduce_counts"],
            )
            if label.startswith("global") and num_micro > 1:
                assert got["accumulating_sbps"] == ["P"], (label, got["accumulating_sbps"])
            assert all(got["unused_grads_none"]), (label, got)


class SharedUnderCheckpoint(nn.Module):
    """``shared`` runs inside a reentrant checkpoint and outside it: two AccumulateGrads."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(6, 6)
        self.shared = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.first(x)
        inner = torch.utils.checkpoint.checkpoint(self.shared, h, use_reentrant=True)
        return self.shared(h) + inner


def accumulated_twice_job() -> dict[str, float]:
    world, rank = sbpflow.env.get_world_size(), sbpflow.env.get_rank()
    torch.manual_seed(0)
    reference = SharedUnderCheckpoint()
    ddp = DistributedDataParallel(copy.deepcopy(reference))  # one bucket: launched at the end
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(8, 6, generator=gen, requires_grad=True)
    y = torch.randn(8, 6, generator=gen)
    F.mse_loss(reference(x), y).backward()
    lx = torch.tensor_split(x.detach(), world)[rank].requires_grad_()
    ly = torch.tensor_split(y, world)[rank]
    F.mse_loss(ddp(lx), ly).backward()
    errors = {}
    for name, ref in reference.named_parameters():
        got = ddp.module.get_parameter(name).grad
        errors[name] = (got - ref.grad).abs().max().item()
    return errors


def test_gradient_accumulated_twice_before_its_launch() -> None:
    """A parameter whose AccumulateGrad runs twice in one backward (reentrant checkpoint),
    both before its bucket is launched: DDP's averaged gradient equals the single-process
    gradient of the whole batch computed in the job (the second gradient is divided too)."""
    for errors in get_pool(2).run(accumulated_twice_job):
        assert errors and max(errors.values()) < _TOL, errors


def removed_sync_job() -> dict[str, Any]:
    """Gradients of a global model while synced, after ``remove()`` and synced again."""
    world, rank = sbpflow.env.get_world_size(), sbpflow.env.get_rank()
    placement = sbpflow.placement("cpu", list(range(world)))
    torch.manual_seed(0)
    reference = Net()
    model = copy.deepcopy(reference).to_global(placement, B)
    x, y = _micro_batches(0, 1)[0]
    F.mse_loss(reference(x), y).backward()
    gx, gy = (sbpflow.to_global(t, placement, S0) for t in (x, y))
    out: dict[str, Any] = {}
    sync = sync_gradients(model)
    for phase in ("synced", "removed", "synced again"):
        model.zero_grad()
        events: list[str] = []
        with _recording_launches(events):
            F.mse_loss(model(gx), gy).backward()
        grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        out[phase] = {
            "launches": len(events),
            "names": sorted(grads),
            "layouts": sorted({sbp_str(g.sbp) for g in grads.values()}),
            "error": max(
                (g.to_local() - reference.get_parameter(n).grad).abs().max().item()
                for n, g in grads.items()
            ),
        }
        if phase == "synced":
            sync.remove()
        elif phase == "removed":
            sync = sync_gradients(model)
    return out


def test_removed_sync_gives_gradients_back_to_the_default_path() -> None:
    """After ``GradientSync.remove()`` the parameters are back on the default path: their
    next backward finds them again and they join default buckets (launched at its end); ``sync_gradients`` again replaces those by its own. Every
    phase's gradients equal one process's and are broadcast."""
    for result in get_pool(2).run(removed_sync_job):
        assert result["synced"]["launches"] == 1, result
        assert result["removed"]["launches"] == 1, result
        assert result["synced again"]["launches"] == 1, result
        for phase in result.values():
            assert phase["names"] == ["fc1.bias", "fc1.weight", "fc2.bias", "fc2.weight"], result
            assert phase["layouts"] == ["B"], result
            assert phase["error"] < _TOL, result
