"""Meshes of three axes make a group per axis and one of the whole mesh (NOTE [meshes] in
comm/_mesh.py), and every layout change and data-parallel step on them equals one process.

On four ranks, meshes 2x2x1, 1x2x2 and 2x1x2: each rank counts the groups its mesh holds
and the sets of ranks it asked for, then boxes sampled pairs of layouts; this process
assembles each logical result from the pieces (``tests/boxing_support.py``) and compares
it with the single-device reference. On eight ranks, a 2x2x2 mesh whose data-parallel
axes are two of the three (a strict subset, which has no group of its own): converting
from local tensors, boxing over two axes and a training step with the default gradient
buckets must equal plain torch on one process.
"""

from __future__ import annotations

import itertools
import random
from typing import Any

import torch
import torch.nn.functional as F

import sbpflow
from sbpflow._layout import Layout, empty_local_shape
from sbpflow.comm import _mesh
from sbpflow.comm._mesh import MESHES
from sbpflow.env import get_rank
from sbpflow.sbp import Broadcast, Partial, Split
from sbpflow.tensor import GlobalTensor
from tests.boxing_support import assemble, make_locals, reference

S0, S1, B, P = Split(0), Split(1), Broadcast(), Partial("sum")
SHAPES = [(2, 2, 1), (1, 2, 2), (2, 1, 2)]
TENSOR = (7, 5)


def _mesh_of(shape: tuple[int, int, int]) -> sbpflow.placement:
    return sbpflow.placement("cpu", torch.arange(4).reshape(shape).tolist())


def _cases(shape: tuple[int, int, int]) -> list[tuple[Layout, Layout]]:
    mesh = _mesh_of(shape)
    signatures = list(itertools.product((S0, S1, B, P), repeat=3))
    rnd = random.Random(sum(i * n for i, n in enumerate(shape)))
    return [
        (Layout(mesh, rnd.choice(signatures)), Layout(mesh, rnd.choice(signatures)))
        for _ in range(60)
    ]


def boxing_job() -> dict[str, Any]:
    rank = get_rank()
    asked: list[tuple[int, ...]] = []
    real = _mesh.group_of

    def recording(device_type: str, groups: Any, me: int, tag: Any = None) -> Any:
        asked.extend(tuple(g) for g in groups)
        return real(device_type, groups, me, tag)

    out: dict[str, Any] = {"groups": {}, "pieces": {}}
    _mesh.group_of = recording  # type: ignore[assignment]
    try:
        for shape in SHAPES:
            asked.clear()
            mesh = MESHES.of(_mesh_of(shape), "a test")
            made = {g for g in asked if len(g) > 1}
            out["groups"][shape] = (len(mesh._mine), len(made))
    finally:
        _mesh.group_of = real  # type: ignore[assignment]
    for shape in SHAPES:
        results = []
        for src, dst in _cases(shape):
            local = make_locals(reference(TENSOR), src).get(rank, torch.empty(empty_local_shape(2)))
            y = GlobalTensor(local, src, TENSOR).to_global(dst.placement, dst.sbp, check_meta=False)
            results.append(y.to_local().detach())
        out["pieces"][shape] = results
    return out


def test_three_axis_meshes_of_four_ranks(pool: Any) -> None:
    """Each mesh holds at most 4 groups per rank (one per axis, the whole mesh) and asked
    for 5 groups of more than one rank; every sampled layout change gives the reference."""
    per_rank = pool(4).run(boxing_job)
    for shape in SHAPES:
        for r in range(4):
            held, made = per_rank[r]["groups"][shape]
            assert held <= 4 and made == 5, (shape, r, held, made)
        problems = []
        for index, (src, dst) in enumerate(_cases(shape)):
            pieces = {r: per_rank[r]["pieces"][shape][index] for r in dst.placement.flat_ranks}
            got = assemble(TENSOR, dst, pieces)
            if not torch.equal(got, reference(TENSOR)):
                problems.append(f"{src.describe()} -> {dst.describe()}")
        assert not problems, (shape, problems)


def cube_job() -> dict[str, Any]:
    """On 2x2x2: data parallel over axes 0 and 1, a column-parallel Linear over axis 2."""
    cube = sbpflow.placement("cpu", torch.arange(8).reshape(2, 2, 2).tolist())
    torch.manual_seed(0)
    reference_model = torch.nn.Linear(6, 4)
    model = torch.nn.Linear(6, 4)
    model.load_state_dict(reference_model.state_dict())
    for name in ("weight", "bias"):
        whole = getattr(model, name).detach().to_global(cube, (B, B, B))
        setattr(model, name, torch.nn.Parameter(whole.to_global(sbp=(B, B, S0))))
    gen = torch.Generator().manual_seed(1)
    errors = []
    for _ in range(3):  # the first backward makes the buckets, the next use them
        x, y = torch.randn(8, 6, generator=gen), torch.randn(8, 4, generator=gen)
        for p in (*model.parameters(), *reference_model.parameters()):
            p.grad = None
        F.mse_loss(reference_model(x), y).backward()
        gx = x.to_global(cube, (B, B, B)).to_global(sbp=(S0, S0, B))
        gy = y.to_global(cube, (B, B, B)).to_global(sbp=(S0, S0, S1))
        F.mse_loss(model(gx), gy).backward()
        with torch.no_grad():
            for p, q in zip(model.parameters(), reference_model.parameters(), strict=True):
                assert p.grad.sbp == p.sbp, (p.grad.sbp, p.sbp)
                errors.append((p.grad.to_global(sbp=(B, B, B)).to_local() - q.grad).abs().max())
                p -= 0.1 * p.grad
                q -= 0.1 * q.grad
    # boxing over two of the three axes: P on both -> B on both, and S -> B on both
    value = torch.arange(40.0).reshape(8, 5)
    held = value.clone() if get_rank() in (0, 1) else torch.zeros(8, 5)  # a0 = a1 = 0
    partial = GlobalTensor(held, Layout(cube, (P, P, B)), (8, 5))
    split = value.to_global(cube, (B, B, B)).to_global(sbp=(S0, B, S0))
    boxed = [
        partial.to_global(sbp=(B, B, B)).to_local(),
        split.to_global(sbp=(B, B, S0)).to_global(sbp=(B, B, B)).to_local(),
    ]
    return {
        "groups": len(MESHES.of(cube, "a test")._mine),
        "errors": [float(e) for e in errors],
        "boxed": [float((b - value).abs().max()) for b in boxed],
    }


def test_data_parallel_over_two_axes_of_a_2x2x2_mesh(pool: Any) -> None:
    """Gradients reduced along the two data axes one after another, a local tensor
    broadcast along them one after another, and boxing over both equal one process."""
    for got in pool(8).run(cube_job):
        assert got["groups"] == 4, got
        assert max(got["errors"]) < 1e-5, got
        assert got["boxed"] == [0.0, 0.0], got
