"""The shared-memory arena of CPU collectives, driven by threads (no process group).

Each thread plays one member with its own mapping of the same file, as the
ranks of one host do (NOTE [shared-memory collectives]). Results are compared
with the same collective computed in one process. Small slots make every
collective run in several rounds.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from sbpflow.comm import _shared_arena, _shared_memory
from sbpflow.comm._shared_arena import SharedArena

from .test_shared_table import _in_threads

pytestmark = pytest.mark.skipif(not _shared_arena.SUPPORTED, reason="x86 only (NOTE)")


def _arenas(
    tmp_path: Path, members: int, slot_bytes: int, pids: list[int] | None = None
) -> list[SharedArena]:
    path = str(tmp_path / "arena")
    _shared_memory.create_file(path, _shared_arena.size_in_bytes(members, slot_bytes))
    pids = pids or [os.getpid()] * members
    ranks = [10 + m for m in range(members)]  # world ranks differ from member numbers
    return [_shared_arena.map_arena(path, m, ranks, pids, slot_bytes) for m in range(members)]


def _inputs(members: int, shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> list:
    generator = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return [torch.randn(shape, generator=generator).to(dtype) for _ in range(members)]
    return [torch.randint(-50, 50, shape, generator=generator, dtype=dtype) for _ in range(members)]


# slot_bytes 256: a float32 piece of 1000 items takes 16 rounds, and the
# reduce_scatter / all_to_all segments are cut further per member.
@pytest.mark.parametrize("members", [2, 3, 4])
@pytest.mark.parametrize("slot_bytes", [256, 64 * 1024])
def test_all_gather_matches_concatenation(tmp_path: Path, members: int, slot_bytes: int) -> None:
    arenas = _arenas(tmp_path, members, slot_bytes)
    for call, shape in enumerate([(1000,), (7, 3), (1,)]):  # consecutive calls reuse the arena
        pieces = _inputs(members, shape, torch.float32, seed=call)
        expected = torch.stack(pieces)

        def job(m: int, pieces: list = pieces, shape: tuple = shape) -> torch.Tensor:
            out = torch.empty((members, *shape))
            arenas[m].all_gather(out, pieces[m], timeout_s=30)
            return out

        for got in _in_threads(members, job):
            assert isinstance(got, torch.Tensor), got
            assert torch.equal(got, expected)


@pytest.mark.parametrize("members", [2, 3, 4])
@pytest.mark.parametrize("reduce_op", ["sum", "max"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int64])
def test_all_reduce_and_reduce_scatter_match_one_process(
    tmp_path: Path, members: int, reduce_op: str, dtype: torch.dtype
) -> None:
    arenas = _arenas(tmp_path, members, slot_bytes=512)
    blocks = _inputs(members, (members * 301,), dtype, seed=members)
    stacked = torch.stack(blocks)
    expected = stacked.sum(0) if reduce_op == "sum" else stacked.amax(0)

    def job(m: int) -> tuple[torch.Tensor, torch.Tensor]:
        reduced = blocks[m].clone()
        arenas[m].all_reduce(reduced, reduce_op, timeout_s=30)
        scattered = torch.empty(301, dtype=dtype)
        arenas[m].reduce_scatter(scattered, blocks[m], reduce_op, timeout_s=30)
        return reduced, scattered

    results = _in_threads(members, job)
    for m, result in enumerate(results):
        assert isinstance(result, tuple), result
        reduced, scattered = result
        torch.testing.assert_close(reduced, expected)
        torch.testing.assert_close(scattered, expected[m * 301 : (m + 1) * 301])
    # every member holds the very same reduced bits (a broadcast result must agree)
    assert all(torch.equal(r[0], results[0][0]) for r in results)  # type: ignore[index]


@pytest.mark.parametrize("members", [2, 3, 4])
def test_all_to_all_with_uneven_and_empty_pieces(tmp_path: Path, members: int) -> None:
    arenas = _arenas(tmp_path, members, slot_bytes=512)
    # member j sends sizes[j][k] items to member k; some pieces are empty, one spans rounds
    sizes = [[(j * 7 + k * 13) % 5 * 40 for k in range(members)] for j in range(members)]
    sizes[0][members - 1] = 700
    sends = [torch.arange(sum(row), dtype=torch.float64) + 1000 * j for j, row in enumerate(sizes)]

    def expected_for(k: int) -> torch.Tensor:
        pieces = [torch.split(sends[j], sizes[j])[k] for j in range(members)]
        return torch.cat(pieces)

    def job(k: int) -> torch.Tensor:
        recv_splits = [sizes[j][k] for j in range(members)]
        out = torch.empty(sum(recv_splits), dtype=torch.float64)
        arenas[k].all_to_all(out, sends[k], recv_splits, sizes[k], timeout_s=30)
        return out

    for k, got in enumerate(_in_threads(members, job)):
        assert isinstance(got, torch.Tensor), got
        assert torch.equal(got, expected_for(k))


def test_members_running_different_collectives_all_raise(tmp_path: Path) -> None:
    arenas = _arenas(tmp_path, 2, slot_bytes=1024)

    def job(m: int) -> None:
        if m == 0:
            arenas[0].all_gather(torch.empty(2, 4), torch.ones(4), timeout_s=30)
        else:
            arenas[1].all_reduce(torch.ones(4), "sum", timeout_s=30)

    for m, error in enumerate(_in_threads(2, job)):
        assert isinstance(error, RuntimeError), (m, error)
        assert "the ranks run different collectives" in str(error)
        assert "runs all_gather of 16 bytes per rank" in str(error), error
        assert "runs all_reduce of 16 bytes (torch.float32, sum)" in str(error), error
    with pytest.raises(RuntimeError, match="out of step; restart the job"):
        arenas[0].all_reduce(torch.ones(4), "sum", timeout_s=1)


def test_a_member_that_never_arrives_times_out_naming_its_world_rank(tmp_path: Path) -> None:
    arenas = _arenas(tmp_path, 2, slot_bytes=1024)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"timed out after 1 s .*ranks \[11\] never arrived"):
        arenas[0].all_reduce(torch.ones(4), "sum", timeout_s=1.0)
    assert 1.0 <= time.monotonic() - start < 10


def test_a_member_process_that_exited_is_noticed_before_the_timeout(tmp_path: Path) -> None:
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    arenas = _arenas(tmp_path, 2, slot_bytes=1024, pids=[os.getpid(), gone.pid])
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=rf"rank 11 \(pid {gone.pid}\) exited"):
        arenas[0].all_gather(torch.empty(2, 4), torch.ones(4), timeout_s=60.0)
    assert time.monotonic() - start < 5


def test_slot_sizes_grow_by_four_within_bounds() -> None:
    assert _shared_arena.slot_bytes_for(1) == 64 * 1024
    assert _shared_arena.slot_bytes_for(64 * 1024 + 1) == 256 * 1024
    assert _shared_arena.slot_bytes_for(10**9) == _shared_arena.MAX_SLOT_BYTES


@pytest.mark.parametrize("members", [2, 3, 5])
@pytest.mark.parametrize("piece_bytes", [1, 64, 100, 4096])
def test_a_slot_of_the_segmented_need_holds_a_piece_per_member(
    tmp_path: Path, members: int, piece_bytes: int
) -> None:
    need = _shared_arena.segmented_need(members, piece_bytes)
    (arena, *_) = _arenas(tmp_path, members, slot_bytes=need)
    assert piece_bytes <= arena._segment_bytes() < piece_bytes + 64


def test_reserving_a_file_larger_than_the_filesystem_fails_cleanly(tmp_path: Path) -> None:
    path = str(tmp_path / "huge")
    with pytest.raises(OSError):
        _shared_memory.create_file(path, 2**62, reserve=True)
    assert not os.path.exists(path)  # nothing left behind


def test_closing_leaves_tensors_that_view_the_arena_valid(tmp_path: Path) -> None:
    (arena,) = _arenas(tmp_path, 1, slot_bytes=4096)
    view = arena._slot(0, 0)  # as an op's slot view would be, were one alive at regrowth
    arena.close()
    view.fill_(7)  # an unmapped view would crash the process here
    assert int(view.sum()) == 7 * 4096


def test_slots_too_small_to_cut_per_member_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="at least 64 per member, got 128 for 3 members"):
        _arenas(tmp_path, 3, slot_bytes=128)
