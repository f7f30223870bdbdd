"""GPU tier: CuPy kernels and NCCL boxing, compared with CPU/single-process references.

Skipped when CUDA is absent. NCCL refuses two ranks on one GPU, so NCCL runs at
world size 1 here; multi-rank GPU checks go through gloo in tests/dist.
"""

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("sizes", [[4, 3, 3, 3], [1, 1, 0, 0], [7, 6], [5, 4, 4, 4, 0]])
def test_pad_chunks_cupy_matches_reference(sizes):
    """The CuPy kernel's result equals the CPU reference path."""
    import sbpflow_kernels

    if not sbpflow_kernels.cupy_available():
        pytest.skip("CuPy is not installed")
    rows = torch.randn(sum(sizes), 5, 3)
    expected = sbpflow_kernels.pad_chunks(rows, sizes)
    got = sbpflow_kernels.pad_chunks(rows.cuda(), sizes)
    torch.cuda.synchronize()
    assert torch.equal(got.cpu(), expected)


@pytest.mark.parametrize(
    "dtype,row_shape",
    [
        (torch.float32, (4,)),  # 16-byte rows
        (torch.float32, (3,)),  # 12-byte rows: 4-byte words
        (torch.bfloat16, (5,)),  # 10-byte rows: 2-byte words
        (torch.uint8, (7,)),  # 7-byte rows: bytes
        (torch.float64, (1,)),  # 8-byte rows
        (torch.bfloat16, (64, 33)),  # wide rows
    ],
    ids=str,
)
def test_pad_chunks_every_word_size_matches_reference(dtype, row_shape):
    """Each word width of the CuPy kernel (NOTE [vectorized padding]) gives the torch path's
    buffer, also for a source that starts at an odd offset of its storage."""
    import sbpflow_kernels
    from sbpflow_kernels.pack import _is_balanced, pad_chunks_torch

    if not sbpflow_kernels.cupy_available():
        pytest.skip("CuPy is not installed")
    sizes = [4, 4, 3, 3, 3]  # balanced: the kernel's case
    base = (torch.rand(sum(sizes) + 1, *row_shape) * 100).to(dtype)
    assert _is_balanced(sizes)
    on_device = base.cuda()
    for source, plain in ((on_device[1:], base[1:]), (on_device[:-1], base[:-1])):
        # on_device[1:] starts one row into its storage: narrower words where rows are odd
        got = sbpflow_kernels.pad_chunks(source, sizes)
        torch.cuda.synchronize()
        expected = pad_chunks_torch(plain, sizes)
        assert expected.shape == (len(sizes) * max(sizes), *row_shape)
        assert torch.equal(got.cpu(), expected)


def test_nccl_world_of_one_boxing_matches_single_process():
    """A cuda placement of one rank: every conversion keeps the single-process value."""
    import sbpflow
    from sbpflow import sbp

    placement = sbpflow.placement("cuda", [0])
    x = torch.randn(8, 12)
    g = x.to_global(placement, sbp.split(0))
    assert g._local.is_cuda
    for dst in (sbp.broadcast, sbp.split(1), sbp.partial_sum, sbp.split(0)):
        out = g.to_global(sbp=dst).to_global(sbp=sbp.broadcast).to_local()
        assert torch.allclose(out.cpu(), x)


def test_cuda_global_matmul_matches_cpu():
    """Ops on cuda global tensors give the CPU result."""
    import sbpflow
    from sbpflow import sbp

    placement = sbpflow.placement("cuda", [0])
    a, b = torch.randn(6, 4), torch.randn(4, 5)
    out = (a.to_global(placement, sbp.split(0)) @ b.to_global(placement, sbp.broadcast)).to_local()
    assert torch.allclose(out.cpu(), a @ b, atol=1e-5)
