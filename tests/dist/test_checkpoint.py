"""Checkpoints of global tensors (sbpflow.save / load / async_save / export_safetensors).

Every value is checked against plain single-process PyTorch tensors computed
in the same test (the logical tensors the ranks laid out), and training
against a plain model trained in the same job. Checkpoints written by 4 ranks
load on 2 ranks in other layouts and in a plain process (a world of one); a
save killed with SIGKILL leaves the previous checkpoint loadable.
"""

from __future__ import annotations

import glob
import os
import pickle
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import sbpflow
from sbpflow.testing import RemoteError, get_pool

from ._ops_support import S0, S1, B, P, logical, make, placement, world
from ._plain_process import run_in_plain_process



def _logical_values() -> dict[str, torch.Tensor]:
    """The logical tensors every test lays out (plain PyTorch, the same in every process)."""
    gen = torch.Generator().manual_seed(3)
    return {
        "uneven": torch.randn(13, 3, generator=gen),  # 13 rows over 4 ranks: 4, 3, 3, 3
        "mesh": torch.randn(6, 5, generator=gen),
        "partial": torch.randint(-8, 8, (5, 4), generator=gen).float(),  # sums exactly
        "replicated": torch.randn(7, generator=gen),
        "scalar": torch.tensor(2.5),
        "empty": torch.zeros(0, 3),
    }


def _state(values: dict[str, torch.Tensor], layouts: dict[str, tuple[Any, Any]]) -> dict[str, Any]:
    """A nested state dict of global tensors laid out as ``layouts`` (name -> (ranks, sbp))."""
    tensors = {
        name: make(values[name], placement(ranks), sbp) for name, (ranks, sbp) in layouts.items()
    }
    return {
        "model": {k: tensors[k] for k in ("uneven", "mesh", "partial")},
        "extra": [tensors["replicated"], tensors["scalar"], tensors["empty"]],
        "plain": values["replicated"] * 3,
        "step": 7,
        "note": {"name": "run-1", "lrs": [0.1, 0.01]},
    }


_SAVED_ON_4 = {
    "uneven": ([0, 1, 2, 3], S0),
    "mesh": ([[0, 1], [2, 3]], (S0, S1)),
    "partial": ([0, 1, 2, 3], P),
    "replicated": ([0, 1, 2, 3], B),
    "scalar": ([0, 1, 2, 3], B),
    "empty": ([0, 1, 2, 3], S0),
}
_LOADED_ON_2 = {
    "uneven": ([0, 1], B),
    "mesh": ([1, 0], S1),
    "partial": ([0, 1], S0),
    "replicated": ([0, 1], P),
    "scalar": ([1], B),
    "empty": ([0, 1], B),
}


def _zeroed(state: dict[str, Any]) -> None:
    """Overwrite every value of ``state`` so that a load must bring each one back."""
    for t in [*state["model"].values(), *state["extra"]]:
        t.to_local().zero_()
    state["plain"].zero_()
    state["step"] = 0
    state["note"] = {"name": "", "lrs": []}


def _whole(x: sbpflow.GlobalTensor) -> torch.Tensor:
    """The logical value on every rank of the world (a collective)."""
    return x.to_global(world(), B).to_local().detach()


def _flat_logical(state: dict[str, Any]) -> dict[str, Any]:
    logical = _whole
    return {
        **{k: logical(v) for k, v in state["model"].items()},
        "replicated": logical(state["extra"][0]),
        "scalar": logical(state["extra"][1]),
        "empty": logical(state["extra"][2]),
        "plain": state["plain"].clone(),
        "step": state["step"],
        "note": state["note"],
    }


def save_on_4(path: str) -> dict[str, int]:
    """Worker: save the layouts of ``_SAVED_ON_4``; return the collectives the save ran."""
    state = _state(_logical_values(), _SAVED_ON_4)
    with sbpflow.boxing.trace() as t:
        sbpflow.save(state, path)
    return dict(t.collectives())


def load_on_2(path: str) -> dict[str, Any]:
    """Worker: load into zeroed tensors laid out as ``_LOADED_ON_2``; return logical values."""
    state = _state(_logical_values(), _LOADED_ON_2)
    _zeroed(state)
    with sbpflow.boxing.trace() as t:
        sbpflow.load(path, state)
    return {"values": _flat_logical(state), "collectives": dict(t.collectives())}


def load_in_plain_process(path: str, out: str) -> None:
    """Run in a plain process (no launcher: a world of one); pickles the loaded values to ``out``."""
    assert "RANK" not in os.environ and "WORLD_SIZE" not in os.environ
    layouts = {name: ([0], B if name == "scalar" else S0) for name in _SAVED_ON_4}
    state = _state(_logical_values(), layouts)
    _zeroed(state)
    plain_sd = {"model": {k: torch.zeros(v.shape) for k, v in state["model"].items()}}
    sbpflow.load(path, state)
    sbpflow.load(path, plain_sd)  # local tensors load as full tensors
    values = _flat_logical(state)
    values["plain_model"] = plain_sd["model"]
    with open(out, "wb") as f:
        pickle.dump(values, f)


def _expected() -> dict[str, Any]:
    values = _logical_values()
    return {
        **values,
        "plain": values["replicated"] * 3,
        "step": 7,
        "note": {"name": "run-1", "lrs": [0.1, 0.01]},
    }


def _assert_same(got: dict[str, Any], want: dict[str, Any]) -> None:
    for key, expected in want.items():
        if isinstance(expected, torch.Tensor):
            assert got[key].shape == expected.shape, key
            assert torch.equal(got[key], expected), key
        else:
            assert got[key] == expected, key


def test_saved_on_4_ranks_loads_on_2_ranks_and_in_a_plain_process(tmp_path: Path) -> None:
    """4 ranks save S(0)/(S(0),S(1))/P/B tensors; 2 ranks load as B/S(1)/S(0)/P; 1 plain process.

    Compared with the plain logical tensors built in this test.
    """
    from torch.distributed.checkpoint import FileSystemReader

    path = str(tmp_path / "ckpt")
    collectives = get_pool(4).run(save_on_4, path)
    # The partial tensor was reduced before writing (reduce_scatter to S(0)), nothing else moved.
    assert all(c == {"reduce_scatter": 1} for c in collectives), collectives
    chunks = {
        key: sorted(tuple(c.offsets) for c in md.chunks)
        for key, md in FileSystemReader(path).read_metadata().state_dict_metadata.items()
        if hasattr(md, "chunks")
    }
    assert chunks["model.uneven"] == [(0, 0), (4, 0), (7, 0), (10, 0)]  # one per shard
    assert chunks["model.mesh"] == [(0, 0), (0, 3), (3, 0), (3, 3)]
    assert chunks["extra.0"] == [(0,)]  # broadcast: written once
    assert chunks["extra.2"] == [(0, 0)]  # no elements: still one (empty) chunk
    assert chunks["plain"] == [(0,)]
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]  # the tmp directory was renamed away

    for result in get_pool(2).run(load_on_2, path):
        _assert_same(result["values"], _expected())
        # Every rank read its own chunks; partial layouts were read as broadcast, then boxed
        # to partial locally: the load communicated nothing.
        assert set(result["collectives"]) <= {"zero"}, result["collectives"]

    out = str(tmp_path / "plain.pkl")
    run_in_plain_process("tests.dist.test_checkpoint", "load_in_plain_process", path, out)
    with open(out, "rb") as f:
        got = pickle.load(f)
    _assert_same(got, _expected())
    for key in ("uneven", "mesh", "partial"):
        assert torch.equal(got["plain_model"][key], _expected()[key])


# -- training: model + AdamW + GradScaler -------------------------------------------------


def _train_step(model: torch.nn.Module, opt: Any, scaler: Any, x: Any, y: Any) -> float:
    opt.zero_grad()
    loss = ((model(x) - y) ** 2).mean()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    value = logical(loss) if isinstance(loss, sbpflow.GlobalTensor) else loss
    return float(value.detach())


def _trainer(seed: int, layout: Any) -> tuple[torch.nn.Module, Any, Any]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    if layout is not None:
        pl = world()
        model = model.to_global(pl, B).to_global(pl, layout)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)
    return model, opt, torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=1)


def resume_training(path: str, steps: int) -> dict[str, Any]:
    """Worker: train ``steps`` steps, save, take one more step (loss L); fresh models load and
    take the same step, in the saved layout and resharded; a plain model is the reference."""
    pl = world()
    gen = torch.Generator().manual_seed(5)
    x, y = torch.randn(8, 6, generator=gen), torch.randn(8, 3, generator=gen)
    gx, gy = make(x, pl, S0), make(y, pl, S0)
    column = lambda name, t: S0  # noqa: E731  (weights' rows and biases split)
    model, opt, scaler = _trainer(0, column)
    reference, ref_opt, ref_scaler = _trainer(0, None)
    for _ in range(steps):
        _train_step(model, opt, scaler, gx, gy)
        _train_step(reference, ref_opt, ref_scaler, x, y)
    sbpflow.save({"model": model, "optim": opt, "scaler": scaler}, path)
    loss = _train_step(model, opt, scaler, gx, gy)
    ref_loss = _train_step(reference, ref_opt, ref_scaler, x, y)
    resumed = {}
    for name, layout in (("same layout", column), ("data parallel", lambda n, t: B)):
        fresh, fresh_opt, fresh_scaler = _trainer(1, layout)  # other initial values
        sbpflow.load(path, {"model": fresh, "optim": fresh_opt, "scaler": fresh_scaler})
        resumed[name] = _train_step(fresh, fresh_opt, fresh_scaler, gx, gy)
    return {"loss": loss, "reference": ref_loss, "resumed": resumed, "scale": scaler.get_scale()}


@pytest.mark.parametrize("steps", [3, 0])
def test_training_resumes_from_a_checkpoint_with_the_same_loss(tmp_path: Path, steps: int) -> None:
    """Model + AdamW + GradScaler saved after 3 steps (or before the first: an optimizer with no
    state yet); the next step's loss after loading equals the uninterrupted run's (exactly in
    the same layout) and a plain single-process model's."""
    results = get_pool(2).run(resume_training, str(tmp_path / "ckpt"), steps)
    for r in results:
        assert abs(r["loss"] - r["reference"]) < 1e-5
        assert r["resumed"]["same layout"] == r["loss"]
        assert abs(r["resumed"]["data parallel"] - r["loss"]) < 1e-6
        assert r["scale"] == 2.0 ** (11 + steps)  # grown once per step: the scaler was restored
    assert results[0] == results[1]


# -- atomicity: a save killed with SIGKILL ---------------------------------------------------


def save_then_die_mid_save(path: str) -> None:
    """Worker: save ones; start saving twos and SIGKILL this process once its files appear."""
    from sbpflow.checkpoint import _save

    pl = world()
    sbpflow.save({"w": make(torch.ones(8, 4), pl, S0), "step": 1}, path)

    def hold(tmp: str, dst: str) -> None:  # storage too slow to ever reach the rename
        time.sleep(120)

    _save.commit = hold

    def kill_when_written() -> None:
        while not glob.glob(glob.escape(path) + ".tmp-*/*.distcp"):
            time.sleep(0.001)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=kill_when_written, daemon=True).start()
    try:  # a peer killed first may make this rank's save fail: it still waits for its kill
        sbpflow.save({"w": make(torch.full((8, 4), 2.0), pl, S0), "step": 2}, path)
    finally:
        time.sleep(120)


def load_w(path: str) -> tuple[torch.Tensor, Any]:
    state = {"w": make(torch.zeros(8, 4), world(), B), "step": None}
    sbpflow.load(path, state)
    return logical(state["w"]), state["step"]


def test_a_save_killed_midway_leaves_the_previous_checkpoint(tmp_path: Path) -> None:
    """SIGKILL during the second save: ``path`` still loads the first save's values (plain ones)."""
    path = str(tmp_path / "ckpt")
    pool = get_pool(2)
    outcomes = pool.run_expect_errors(save_then_die_mid_save, path, timeout=120.0)
    assert all(isinstance(o, RemoteError) and o.type_name == "WorkerDied" for o in outcomes), (
        outcomes.outcomes
    )
    (tmp,) = glob.glob(path + ".tmp-*")  # the killed save had started writing
    assert glob.glob(os.path.join(tmp, "*.distcp"))
    for w, step in pool.run(load_w, path):  # a fresh pool
        assert torch.equal(w, torch.ones(8, 4))
        assert step == 1


# -- async save ---------------------------------------------------------------------------


def async_save_then_train(path: str) -> dict[str, Any]:
    """Worker: async_save, change the tensors at once, wait; the checkpoint holds the old values."""
    pl = world()
    w = make(torch.arange(12.0).reshape(6, 2), pl, S0)
    plain = torch.ones(3)
    future = sbpflow.checkpoint.async_save({"w": w, "plain": plain}, path)
    w.to_local().add_(100)  # training goes on while the files are written
    plain.add_(100)
    assert future.result() is None
    state = {"w": make(torch.zeros(6, 2), pl, B), "plain": torch.zeros(3)}
    sbpflow.load(path, state)
    return {"w": logical(state["w"]), "plain": state["plain"]}


def test_async_save_writes_the_values_at_the_call(tmp_path: Path) -> None:
    """Values changed right after async_save do not reach the checkpoint (plain references)."""
    for r in get_pool(2).run(async_save_then_train, str(tmp_path / "ckpt")):
        assert torch.equal(r["w"], torch.arange(12.0).reshape(6, 2))
        assert torch.equal(r["plain"], torch.ones(3))


# -- errors on every rank -----------------------------------------------------------------


def bad_calls(tmp: str) -> dict[str, tuple[str, str]]:
    """Worker: each mistake must raise on this rank (the job returns, so no rank hung)."""
    pl = world()
    good = os.path.join(tmp, "good")
    sbpflow.save({"w": make(torch.ones(4, 2), pl, S0)}, good)
    a_file = os.path.join(tmp, "a_file")
    if sbpflow.env.get_rank() == 0:
        Path(a_file).write_text("not a checkpoint")
    calls = {
        "missing checkpoint": lambda: sbpflow.load(
            os.path.join(tmp, "nothing"), {"w": torch.zeros(4, 2)}
        ),
        "missing key": lambda: sbpflow.load(good, {"w": torch.zeros(4, 2), "v": torch.zeros(1)}),
        "shape": lambda: sbpflow.load(good, {"w": make(torch.zeros(2, 4), pl, S0)}),
        "save onto a file": lambda: sbpflow.save({"w": torch.ones(1)}, a_file),
        "path type": lambda: sbpflow.save({"w": torch.ones(1)}, 3),
    }
    raised = {}
    for name, call in calls.items():
        try:
            call()
        except Exception as error:
            raised[name] = (type(error).__name__, str(error))
    state = {"w": make(torch.zeros(4, 2), pl, S0)}
    sbpflow.load(good, state)  # the ranks are still in step
    raised["after"] = ("ok", str(logical(state["w"]).sum().item()))
    return raised


def test_mistakes_raise_a_clear_error_on_every_rank(tmp_path: Path) -> None:
    """A missing checkpoint, a key not in it, a wrong shape, a bad path: the same error everywhere."""
    for raised in get_pool(2).run(bad_calls, str(tmp_path)):
        kind, message = raised["missing checkpoint"]
        assert kind == "FileNotFoundError" and "no checkpoint at" in message
        kind, message = raised["missing key"]
        assert kind == "ValueError" and "['v']" in message and "holds ['w']" in message
        kind, message = raised["shape"]
        assert kind == "ValueError" and "[4, 2]" in message and "[2, 4]" in message
        kind, message = raised["save onto a file"]
        assert kind == "ValueError" and "is a file" in message
        kind, message = raised["path type"]
        assert kind == "TypeError" and "got int: 3" in message
        assert raised["after"] == ("ok", "8.0")


# -- safetensors ---------------------------------------------------------------------------


def export(file: str) -> dict[str, int]:
    state = _state(_logical_values(), _SAVED_ON_4)
    del state["note"]
    with sbpflow.boxing.trace() as t:
        sbpflow.export_safetensors(state, file)
    return dict(t.collectives())


def test_export_safetensors_holds_the_logical_tensors(tmp_path: Path) -> None:
    """The one file written from 4 ranks equals the plain logical tensors."""
    safetensors_torch = pytest.importorskip("safetensors.torch")
    file = str(tmp_path / "model.safetensors")
    collectives = get_pool(4).run(export, file)
    assert all(c for c in collectives)  # the shards were gathered to rank 0
    got = safetensors_torch.load_file(file)
    values = _expected()
    want = {
        **{f"model.{k}": values[k] for k in ("uneven", "mesh", "partial")},
        "extra.0": values["replicated"],
        "extra.1": values["scalar"],
        "extra.2": values["empty"],
        "plain": values["plain"],
    }
    assert sorted(got) == sorted(want)
    for key, tensor in want.items():
        assert torch.equal(got[key], tensor), key
    from safetensors import safe_open

    with safe_open(file, "pt") as f:
        assert f.metadata() == {"step": "7"}
