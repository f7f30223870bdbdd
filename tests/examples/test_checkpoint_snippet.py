"""The "Coming from ``torch.save``" program of docs/checkpoints.md runs on 2 ranks every time.

Rank 0 writes ``model.pt`` with ``torch.save`` and every rank then loads it, so the other
ranks must wait for the file; without that wait a rank reaches ``torch.load`` first in some
runs (``FileNotFoundError``). The program runs as written, 20 times in a row in one launch of
2 ranks (each run in a directory of its own, so no earlier run's file hides the race), and
once more with rank 0's ``torch.save`` made late on purpose, which turns the race into a
certain failure for a program that does not wait. What the ranks load is checked against the
model rank 0 saved: each rank's rows of the sharded model are those rows of the saved weights.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from tests.examples._doc_blocks import ROOT, Block, Program, programs, read_page
from tests.examples.test_doc_snippets import _run

PAGE = ROOT / "docs" / "checkpoints.md"
REPEATS = 20

# Rank 0's torch.save starts 2 s late (restored after the program).
_LATE_SAVE = """
import time as _time
import torch as _torch
import sbpflow as _sbpflow

_on_time_save = _torch.save


def _late_save(*args, **kwargs):
    if _sbpflow.env.get_rank() == 0:
        _time.sleep(2.0)
    return _on_time_save(*args, **kwargs)


_torch.save = _late_save
"""
_ON_TIME_SAVE = "_torch.save = _on_time_save\n"

# After the program: every rank's piece of the sharded model is its rows of the saved weights.
_CHECK = """
_saved = _torch.load("model.pt")
_rank, _world = _sbpflow.env.get_rank(), _sbpflow.env.get_world_size()
for _name, _value in sharded.state_dict().items():
    _rows = _saved[_name].tensor_split(_world)[_rank]
    assert _torch.equal(_value.to_local(), _rows), (_name, _value.to_local(), _rows)
    assert _torch.equal(_saved[_name], model.state_dict()[_name].to_local()), _name
"""


def _snippet() -> Program:
    """The page's program that saves ``model.pt`` on rank 0 and loads it on every rank."""
    found = [
        p
        for p in programs(read_page(PAGE))
        if any('torch.save(model.state_dict(), "model.pt")' in b.code for b in p.blocks)
    ]
    assert len(found) == 1, f"expected one program saving model.pt on {PAGE}, found {found}"
    return found[0]


def _block(program: Program, code: str) -> Block:
    return Block(program.page, program.blocks[0].line, code, "continues")


def _checked(program: Program, *, late_save: bool, workdir: str) -> Program:
    """``program`` on 2 ranks, in ``workdir``, its result checked (and rank 0 late if asked)."""
    check = _block(program, "import torch as _torch\nimport sbpflow as _sbpflow\n" + _CHECK)
    blocks = [*program.blocks, check]
    if late_save:
        blocks = [_block(program, _LATE_SAVE), *blocks, _block(program, _ON_TIME_SAVE)]
    return replace(program, ranks=2, blocks=blocks, workdir=workdir)


def test_the_page_runs_it_on_two_ranks() -> None:
    assert _snippet().ranks == 2, "the program is marked to run on one rank only"


def test_it_runs_twenty_times_in_a_row_on_two_ranks(tmp_path: Path) -> None:
    program = _snippet()
    runs = [_checked(program, late_save=False, workdir=f"run{i}") for i in range(REPEATS)]
    failures = _run(runs, 2, tmp_path)
    assert not failures, f"{len(failures)} of {REPEATS} runs failed:\n\n" + "\n\n".join(
        failures.values()
    )


def test_the_other_ranks_wait_for_a_late_save(tmp_path: Path) -> None:
    failures = _run([_checked(_snippet(), late_save=True, workdir="late")], 2, tmp_path)
    assert not failures, "\n\n".join(failures.values())
