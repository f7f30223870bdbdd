"""The checkpoint's pure parts: which chunks ranks write and read, flat keys, the atomic swap.

No process group. Chunk coverage is compared with a plain count over the
logical tensor's elements: every element must be written exactly once.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import sbpflow
from sbpflow._layout import Layout
from sbpflow.checkpoint import _atomic
from sbpflow.checkpoint._chunks import read_chunk, readable_sbp, storable_sbp, write_chunk
from sbpflow.checkpoint._flat import flatten, is_stateful, set_at
from sbpflow.sbp import Broadcast, Partial, Split

S0, S1, B, P = Split(0), Split(1), Broadcast(), Partial("sum")

_LAYOUTS = [
    ([0, 1, 2, 3], (S0,), (13, 3)),  # uneven: 4, 3, 3, 3
    ([0, 1, 2, 3], (S0,), (2, 3)),  # two ranks hold nothing
    ([0, 1, 2, 3], (B,), (5,)),
    ([[0, 1], [2, 3]], (S0, S1), (6, 5)),
    ([[0, 1], [2, 3]], (S0, B), (6, 5)),
    ([[0, 1], [2, 3]], (B, S1), (6, 5)),
    ([[0, 1], [2, 3]], (S0, S0), (7, 2)),  # one dim split twice
    ([[3, 1], [0, 2]], (B, B), ()),  # 0-d, mesh order not rank order
    ([1, 2], (S0,), (4, 4)),  # ranks 0 and 3 are outside
]


@pytest.mark.parametrize(("ranks", "sbp", "shape"), _LAYOUTS)
def test_written_chunks_cover_every_element_once(ranks: Any, sbp: Any, shape: Any) -> None:
    """Plain count per element of the logical tensor: written once; each rank reads its box."""
    layout = Layout(sbpflow.placement("cpu", ranks), sbp)
    count = torch.zeros(shape, dtype=torch.int64)
    for rank in range(4):
        chunk = write_chunk(layout, shape, rank)
        if chunk is not None:
            region = tuple(slice(o, o + n) for o, n in zip(chunk.offsets, chunk.sizes, strict=True))
            count[region] += 1
        read = read_chunk(layout, shape, rank)
        if rank not in layout.placement:
            assert read is None and chunk is None
        elif read is not None:
            assert read.sizes == layout.local_shape(shape, rank)
    assert torch.equal(count, torch.ones(shape, dtype=torch.int64))


def test_a_tensor_with_no_elements_is_written_once_by_the_first_rank() -> None:
    layout = Layout(sbpflow.placement("cpu", [[2, 0], [1, 3]]), (S0, B))
    written = {r: write_chunk(layout, (0, 3), r) for r in range(4)}
    assert [r for r, c in written.items() if c is not None] == [2]
    assert written[2] is not None and written[2].sizes == (0, 3)


def test_partial_axes_are_stored_split_and_read_broadcast() -> None:
    assert storable_sbp((P, S1), (4, 6)) == (S0, S1)
    assert storable_sbp((P,), ()) == (B,)  # a 0-d tensor has no dim to split
    assert storable_sbp((Partial("max"), B), (3,)) == (S0, B)
    assert readable_sbp((P, S0)) == (B, S0)


def test_flat_keys_follow_torch_distributed_checkpoint() -> None:
    w = torch.ones(2)
    state = {
        "model": {"fc.weight": w},
        "optim": {"state": {0: {"exp_avg": w, "step": torch.tensor(1.0)}}, "lrs": [0.1, 0.2]},
        "pair": [w, 3],
        "n": 5,
    }
    flat = flatten(state)
    assert sorted(flat) == [
        "model.fc.weight",
        "n",
        "optim.lrs",  # a list with no tensor is one value
        "optim.state.0.exp_avg",
        "optim.state.0.step",
        "pair.0",
        "pair.1",
    ]
    assert flat["optim.state.0.exp_avg"][0] == ("optim", "state", 0, "exp_avg")  # int key kept
    set_at(state, flat["pair.1"][0], 4)
    set_at(state, flat["optim.lrs"][0], [1.0])
    assert state["pair"][1] == 4 and state["optim"]["lrs"] == [1.0]


def test_flat_key_clashes_and_wrong_types_are_named() -> None:
    with pytest.raises(ValueError, match=r"same checkpoint key 'a\.b'"):
        flatten({"a": {"b": 1}, "a.b": 2})
    with pytest.raises(TypeError, match="state_dict must be a dict, got list"):
        flatten([1])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="a tuple cannot change"):
        set_at({"t": (torch.ones(1), 1)}, ("t", 1), 2)


def test_modules_optimizers_and_scalers_stand_for_their_state_dicts() -> None:
    model = torch.nn.Linear(2, 2)
    assert is_stateful(model)
    assert is_stateful(torch.optim.SGD(model.parameters(), lr=0.1))
    assert is_stateful(torch.amp.GradScaler("cpu"))
    assert not is_stateful({"a": 1}) and not is_stateful(torch.ones(1))


def _checkpoint(path: Path, marker: str) -> None:
    path.mkdir()
    (path / _atomic.METADATA_FILE).write_text(marker)


@pytest.mark.parametrize("exchange", [True, False], ids=["renameat2", "two renames"])
def test_commit_replaces_the_previous_checkpoint(
    tmp_path: Path, exchange: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not exchange:
        monkeypatch.setattr(_atomic, "_exchange", lambda a, b: False)
    path = tmp_path / "ckpt"
    first = Path(_atomic.new_tmp_name(str(path)))
    _checkpoint(first, "first")
    _atomic.commit(str(first), str(path))
    second = Path(_atomic.new_tmp_name(str(path)))
    _checkpoint(second, "second")
    _atomic.commit(str(second), str(path))
    assert (path / _atomic.METADATA_FILE).read_text() == "second"
    assert os.listdir(tmp_path) == ["ckpt"]  # the previous checkpoint and the tmp are gone


def test_target_problems_are_named(tmp_path: Path) -> None:
    a_file = tmp_path / "f"
    a_file.write_text("x")
    assert "is a file" in (_atomic.problem_with_target(str(a_file)) or "")
    other = tmp_path / "other"
    other.mkdir()
    (other / "data.txt").write_text("keep me")
    assert "refuses to delete" in (_atomic.problem_with_target(str(other)) or "")
    assert _atomic.problem_with_target(str(tmp_path / "new" / "ckpt")) is None


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="renameat2 is Linux's")
def test_exchange_swaps_two_directories_in_one_step(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    (a / "from_a").write_text("")
    assert _atomic._exchange(str(a), str(b))  # False would mean the two-rename fallback
    assert os.listdir(a) == [] and os.listdir(b) == ["from_a"]


def test_load_names_what_an_interrupted_save_left(tmp_path: Path) -> None:
    """No ``path`` but a ``.prev-`` directory (a crash between the fallback's two renames)."""
    from sbpflow.checkpoint._load import _problem

    path = tmp_path / "ckpt"
    _checkpoint(tmp_path / "ckpt.prev-abc", "previous")
    kind, message = _problem(str(path), {}) or ("", "")
    assert kind == "FileNotFoundError"
    assert "no such directory" in message and "ckpt.prev-abc" in message


def test_export_without_safetensors_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    from sbpflow.checkpoint import _safetensors

    monkeypatch.setitem(sys.modules, "safetensors.torch", None)  # import fails
    with pytest.raises(ImportError, match="pip install safetensors"):
        _safetensors._save_file()
