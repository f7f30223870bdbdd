"""Device checks of global tensors (NOTE [device moves] in sbpflow/_devices.py), one process.

No process group: the global tensors here are built directly from a local tensor and a
layout, and every check runs before any communication would. The moves themselves are
compared with plain torch in tests/dist/test_device_moves.py and tests/gpu/test_cuda_moves.py.
"""

from __future__ import annotations

import pytest
import torch

import sbpflow
from sbpflow._devices import _requested_device, own_device
from sbpflow._global import GlobalTensor
from sbpflow._layout import Layout
from sbpflow.sbp import Split

CPU = sbpflow.placement("cpu", [0])


def _global(local: torch.Tensor) -> GlobalTensor:
    return GlobalTensor(local, Layout(CPU, (Split(0),)), local.shape)


@pytest.mark.parametrize(
    "args,kwargs,want",
    [
        (("cuda",), {}, torch.device("cuda")),
        (("cuda:1", torch.float16), {}, torch.device("cuda", 1)),
        ((torch.device("cpu"),), {"copy": True}, torch.device("cpu")),
        ((torch.float64,), {}, None),
        ((torch.float64, False, True), {}, None),
        ((), {"device": "cuda", "dtype": torch.float16}, torch.device("cuda")),
        ((torch.zeros(1, dtype=torch.float64),), {}, torch.device("cpu")),
        ((), {"other": torch.zeros(1)}, torch.device("cpu")),
    ],
)
def test_requested_device_of_each_to_signature(args, kwargs, want) -> None:
    """The device each form of ``Tensor.to`` names (None when it names none)."""
    assert _requested_device(args, kwargs) == want


def test_own_device_of_cpu_is_cpu() -> None:
    g = _global(torch.zeros(4, 3))
    assert own_device(torch.device("cpu"), g) == torch.device("cpu")


def test_cuda_without_cuda_names_the_placement_and_what_to_do() -> None:
    """Without CUDA a cuda move names the cuda placement it would make and the way out;
    with CUDA it goes to this rank's own device."""
    g = _global(torch.zeros(4, 3))
    if torch.cuda.is_available():
        assert own_device(torch.device("cuda"), g).type == "cuda"
        return
    with pytest.raises(RuntimeError, match=r"placement\('cuda', \[0\]\).*CUDA is not available"):
        own_device(torch.device("cuda"), g)
    with pytest.raises(RuntimeError, match=r"keep it on placement\('cpu', \[0\]\)"):
        g.cuda()
    with pytest.raises(RuntimeError, match="CUDA is not available"):
        g.to("cuda", torch.float16)


@pytest.mark.parametrize("device", ["meta", "cpu:1"])
def test_devices_no_placement_holds_are_errors(device: str) -> None:
    """``meta`` is no placement type, and ``cpu:1`` is not this rank's cpu device."""
    g = _global(torch.zeros(4, 3))
    with pytest.raises(ValueError, match=device):
        g.to(device)


def test_a_local_on_another_device_type_than_the_placement_is_refused() -> None:
    """The internal invariant: a cpu placement never holds locals of another device type."""
    with pytest.raises(AssertionError, match="meta"):
        _global(torch.zeros(4, 3, device="meta"))


def test_data_takes_a_global_tensor_only() -> None:
    """``p.data = plain`` would leave the global tensor's locals stale: a TypeError naming the
    fix; ``p.data = global`` takes its locals, dtype and metadata, keeping the object."""
    g = _global(torch.zeros(4, 3))
    with pytest.raises(TypeError, match=r"plain Tensor.*to_global"):
        g.data = torch.ones(4, 3)
    new = _global(torch.ones(2, 5, dtype=torch.float64))
    g.data = new
    assert g.dtype == g.to_local().dtype == torch.float64
    assert g.shape == (2, 5) and torch.equal(g.to_local(), torch.ones(2, 5, dtype=torch.float64))
