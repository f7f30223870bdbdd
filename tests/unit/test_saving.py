"""Pickling global tensors in a world of one (NOTE [torch.save of global tensors]).

A 1-rank placement holds the whole value whatever its SBP, so pickling gives plain tensors
equal to the value (compared with the plain tensor it was made from); ``copy.copy`` and
``copy.deepcopy`` still give global tensors; ``torch.save`` is torch's own function, checked
in a process that imports sbpflow after taking it (tests/dist/test_copies.py trains copies).
"""

from __future__ import annotations

import copy
import io
import pickle
import subprocess
import sys

import torch

import sbpflow
from sbpflow.sbp import broadcast, split

ONE = sbpflow.placement("cpu", [0])


def test_a_whole_value_pickles_as_a_plain_tensor() -> None:
    value = torch.arange(6.0).reshape(2, 3)
    for sbp in (broadcast, split(1)):
        got = pickle.loads(pickle.dumps(value.to_global(ONE, sbp)))
        assert type(got) is torch.Tensor and torch.equal(got, value)
    param = torch.nn.Linear(3, 2).to_global(ONE, broadcast).weight
    loaded = torch.load(io.BytesIO(_saved(param)))
    assert type(loaded) is torch.nn.Parameter and loaded.requires_grad
    assert torch.equal(loaded, param.to_local())


def _saved(obj: object) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def test_copies_stay_global() -> None:
    model = torch.nn.Linear(3, 2).to_global(ONE, broadcast)
    shallow = copy.copy(model.weight)
    assert isinstance(shallow, sbpflow.GlobalTensor) and shallow.requires_grad
    assert shallow.to_local().data_ptr() == model.weight.to_local().data_ptr()
    deep = copy.deepcopy(model)
    assert isinstance(deep.weight, sbpflow.GlobalTensor)
    assert torch.equal(deep.weight.to_local(), model.weight.to_local())


def test_torch_save_is_torchs_own_function() -> None:
    script = (
        "import torch; save = torch.save; import sbpflow; "
        "assert torch.save is save is torch.serialization.save, torch.save"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr
    assert torch.save is torch.serialization.save
