"""``torch.save`` / ``torch.load`` on global tensors, state dicts and modules.

NOTE [torch.save of global tensors]: a tensor whose pieces are each the whole value
(broadcast) is written as that value, a plain tensor: default ``torch.load`` reads it in
any process (checked in a process that never imports sbpflow) and ``load_state_dict`` fills
a global model of another layout; the values are compared with the logical values read in
the job. Any other layout (split, partial, a rank outside the placement) makes
``torch.save`` raise, naming ``sbpflow.save``, ``sbpflow.export_safetensors`` and
``to_local()``. ``torch.save`` is torch's own and has opened the file by then: what it
leaves at the path, or in a buffer, is an archive ``torch.load`` refuses, never a piece
that loads.
"""

from __future__ import annotations

import contextlib
import io
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import sbpflow
from sbpflow.sbp import broadcast, partial_sum, split
from sbpflow.testing import DistributedPool

PREVIOUS = b"the previous checkpoint"


def _model(placement: sbpflow.Placement) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Linear(6, 2)).to_global(
        placement, broadcast
    )


def save_and_load_replicated(directory: str) -> dict[str, Any]:
    """Worker: rank 0 saves a broadcast model's state dict and the model; every rank loads."""
    rank, world = sbpflow.env.get_rank(), sbpflow.env.get_world_size()
    placement = sbpflow.placement("cpu", list(range(world)))
    model = _model(placement)
    logical = {name: torch.tensor(p.tolist()) for name, p in model.state_dict().items()}
    state_path, model_path = Path(directory, "state.pt"), Path(directory, "model.pt")
    if rank == 0:
        torch.save(model.state_dict(), state_path)
        torch.save(model, model_path)
    torch.ones(1).to_global(placement, broadcast).tolist()  # every rank waits for rank 0
    state = torch.load(state_path)  # default: weights_only=True
    plain = {name: type(value) is torch.Tensor for name, value in state.items()}
    same = {name: torch.equal(state[name], logical[name]) for name in logical}
    # Into a global model of another layout: each rank keeps its piece of the whole value.
    other = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Linear(6, 2))
    other = other.to_global(placement, broadcast).to_global(placement, split(0))
    other.load_state_dict(state)
    reloaded = {name: torch.equal(torch.tensor(p.tolist()), logical[name])
                for name, p in other.state_dict().items()}  # fmt: skip
    whole = torch.load(model_path, weights_only=False)
    module = {
        name: (type(p) is torch.nn.Parameter, p.requires_grad, torch.equal(p, logical[name]))
        for name, p in whole.named_parameters()
    }
    return {"plain": plain, "same": same, "reloaded": reloaded, "module": module,
            "logical": logical}  # fmt: skip


def _loads(source: Any) -> str:
    """What ``torch.load`` makes of ``source``: 'loaded' or the name of what it raised."""
    try:
        torch.load(source)
    except Exception as error:  # the outcome is the result
        return type(error).__name__
    return "loaded"


def refused_saves(directory: str) -> list[tuple[str, str, bytes, str, str]]:
    """Worker: each case's (name, error or 'saved', bytes at the path after, what torch.load
    makes of the path, and of the buffer written). Rank 0 holds the outside-placement tensor
    whole, so only it may save that."""
    rank, world = sbpflow.env.get_rank(), sbpflow.env.get_world_size()
    placement = sbpflow.placement("cpu", list(range(world)))
    split_model = _model(placement).to_global(placement, split(0))
    cases: dict[str, Any] = {
        "split state dict": split_model.state_dict(),
        "split module": split_model,
        "partial tensor": torch.ones(3).to_global(placement, partial_sum),
        "on a rank outside the placement": torch.ones(3).to_global(
            sbpflow.placement("cpu", [0]), broadcast
        ),
        "in a list, after a broadcast tensor": [
            torch.ones(2).to_global(placement, broadcast),
            torch.ones(4).to_global(placement, split(0)),
        ],
    }
    out = []
    for name, obj in cases.items():
        path, buffer = Path(directory, f"{name}.{rank}.pt"), io.BytesIO()
        path.write_bytes(PREVIOUS)
        outcome = "saved"
        try:
            torch.save(obj, path)
        except TypeError as error:
            outcome = str(error)
        with contextlib.suppress(TypeError):
            torch.save(obj, buffer)
        buffer.seek(0)
        out.append((name, outcome, path.read_bytes(), _loads(path), _loads(buffer)))
    return out


@pytest.mark.parametrize("dist_pool", [2], indirect=True)
def test_a_broadcast_state_dict_saves_as_plain_tensors(
    dist_pool: DistributedPool, tmp_path: Path
) -> None:
    results = dist_pool.run(save_and_load_replicated, str(tmp_path))
    for rank, got in enumerate(results):
        assert all(got["plain"].values()) and all(got["same"].values()), (rank, got)
        assert all(got["reloaded"].values()), (rank, got["reloaded"])
        assert got["module"] and all(all(v) for v in got["module"].values()), (rank, got)
    # A process that never imports sbpflow reads the file with default torch.load.
    logical = results[0]["logical"]
    script = (
        "import sys, torch; state = torch.load(sys.argv[1]); "
        "assert 'sbpflow' not in sys.modules; "
        "print(sorted((k, type(v).__name__, v.tolist()) for k, v in state.items()))"
    )
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": ""}
    done = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path / "state.pt")],
        capture_output=True, text=True, env=env, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    expected = sorted((k, "Tensor", v.tolist()) for k, v in logical.items())
    assert done.stdout.strip() == str(expected)


@pytest.mark.parametrize("dist_pool", [2], indirect=True)
def test_torch_save_of_a_piece_raises_and_leaves_nothing_that_loads(
    dist_pool: DistributedPool, tmp_path: Path
) -> None:
    """torch.save raises; torch's writer has truncated the path and closes an archive with
    no pickle in it (NOTE [torch.save of global tensors]), which torch.load refuses."""
    for rank, results in enumerate(dist_pool.run(refused_saves, str(tmp_path))):
        for name, outcome, on_disk, path_loads, buffer_loads in results:
            if name == "on a rank outside the placement" and rank == 0:
                assert outcome == "saved", outcome  # rank 0 holds it whole
                continue
            where = f"rank {rank}, {name}"
            assert outcome != "saved", where
            for named in ("sbpflow.save(", "sbpflow.export_safetensors(", "x.to_local()"):
                assert named in outcome, f"{where}: {outcome}"
            assert on_disk != PREVIOUS and on_disk.startswith(b"PK"), f"{where}: {on_disk[:40]!r}"
            assert path_loads == buffer_loads == "RuntimeError", (where, path_loads, buffer_loads)
