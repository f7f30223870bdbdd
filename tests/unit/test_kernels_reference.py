"""sbpflow_kernels' torch reference paths, compared with a plain single-process construction."""

import pytest
import torch

import sbpflow_kernels


@pytest.mark.parametrize("sizes", [[4, 3, 3, 3], [1, 1, 0, 0], [2, 2], [5]])
def test_pad_chunks_places_each_chunk_at_its_block(sizes):
    rows = torch.arange(sum(sizes) * 3, dtype=torch.float32).view(sum(sizes), 3)
    padded = sbpflow_kernels.pad_chunks(rows, sizes)
    longest = max(sizes)
    assert padded.shape == (len(sizes) * longest, 3)
    start = 0
    for k, s in enumerate(sizes):
        block = padded[k * longest : (k + 1) * longest]
        assert torch.equal(block[:s], rows[start : start + s])
        assert torch.count_nonzero(block[s:]) == 0
        start += s
    assert start == rows.shape[0]


def test_bad_sizes_are_a_clear_error():
    with pytest.raises(ValueError, match="do not add up"):
        sbpflow_kernels.pad_chunks(torch.zeros(5, 2), [2, 2])


def test_import_sbpflow_does_not_import_cupy():
    import subprocess
    import sys

    code = "import sys, sbpflow, sbpflow_kernels; print('cupy' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
