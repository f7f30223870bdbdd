"""Run documentation programs on this rank: ``python -m tests.examples._doc_runner PLAN OUT START``.

PLAN is a JSON list of programs (see ``_doc_blocks.Program``), all for the same number of
ranks; this process runs programs START, START+1, ... in order, as the launcher runs a
script on every rank, or plainly for a world of one. Each program gets a fresh namespace
(``__name__ == "__main__"``), a working directory of its page (``OUT/work/<page>``, shared
by the ranks, so a file a block writes is there for the next block of the page; a program
may name another with ``"workdir"``), and the
random state of a fresh process. Its code is compiled with the page's path and line
numbers, so a traceback points into the Markdown file.

After each program every rank appends one JSON line to ``OUT/rank<r>.jsonl``:
``{"index": i, "seconds": s}`` when it ran, or ``{"index": i, "where": "page:line", "error": traceback}``
for the first block that raised (or printed something other than its shown output), after
which the rank stops, and the launcher stops the others.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import json
import os
import re
import sys
import time
import traceback
from pathlib import Path
from typing import Any, TextIO

import torch

import sbpflow

ROOT = Path(__file__).resolve().parents[2]


class _Tee(io.TextIOBase):
    """Writes to the real stdout and keeps a copy, so a block's output can be compared."""

    def __init__(self, stream: TextIO) -> None:
        self._stream, self.copy = stream, io.StringIO()

    def write(self, text: str) -> int:
        self.copy.write(text)
        return self._stream.write(text)

    def flush(self) -> None:
        self._stream.flush()


def matches(expected: str, printed: str) -> bool:
    """Whether ``printed`` is the shown output, ``...`` standing for any text (as doctest's
    ELLIPSIS), trailing spaces and blank lines at either end ignored."""

    def normal(text: str) -> str:
        return "\n".join(line.rstrip() for line in text.strip("\n").splitlines())

    pattern = ".*?".join(re.escape(part) for part in normal(expected).split("..."))
    return re.fullmatch(pattern, normal(printed), flags=re.DOTALL) is not None


def _compiled(block: dict[str, Any], page: str) -> Any:
    # Blank lines in front put the code at the page's own line numbers.
    return compile("\n" * block["line"] + block["code"], str(ROOT / page), "exec")


def _run_script(program: dict[str, Any], rank: int, record: dict[str, Any]) -> None:
    namespace: dict[str, Any] = {"__name__": "__main__", "__builtins__": __builtins__}
    for block in program["blocks"]:
        where = record["where"] = f"{program['page']}:{block['line']}"
        tee = _Tee(sys.stdout)
        with contextlib.redirect_stdout(tee):
            exec(_compiled(block, program["page"]), namespace)
        expected = block.get("expected_output")
        if rank == 0 and expected is not None and not matches(expected, tee.copy.getvalue()):
            raise AssertionError(
                f"{where} printed\n{tee.copy.getvalue()}\nbut the page shows\n{expected}"
            )


def _run_test_module(program: dict[str, Any]) -> None:
    """Save the block as a module (importable by ranks the tests spawn) and call its tests."""
    block = program["blocks"][0]
    name = "doc_" + re.sub(r"\W", "_", f"{Path(program['page']).stem}_{block['line']}")
    Path(f"{name}.py").write_text("\n" * block["line"] + block["code"])
    sys.path.insert(0, os.getcwd())
    module = importlib.import_module(name)
    tests = [getattr(module, n) for n in dir(module) if n.startswith("test_")]
    if not tests:
        raise AssertionError(f"{program['page']}:{block['line']} defines no test_* function")
    for test in tests:
        test()


def _traceback_from_the_page(error: BaseException) -> str:
    """The traceback without this runner's frames: it starts at the page's line."""
    tb = error.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename == __file__:
        tb = tb.tb_next
    return "".join(traceback.format_exception(type(error), error, tb))


def main(argv: list[str]) -> int:
    plan, out, start = json.loads(Path(argv[0]).read_text()), Path(argv[1]), int(argv[2])
    rank = int(os.environ.get("RANK", "0"))
    fresh_torch_state = torch.get_rng_state()
    for index in range(start, len(plan)):
        program = plan[index]
        workdir = out / "work" / re.sub(r"\W", "_", program.get("workdir", program["page"]))
        workdir.mkdir(parents=True, exist_ok=True)
        os.chdir(workdir)
        sbpflow.manual_seed(0)  # sbpflow's random state as a fresh process starts with it
        torch.set_rng_state(fresh_torch_state)
        record: dict[str, Any] = {"index": index, "where": f"{program['page']}:?"}
        started = time.perf_counter()
        try:
            if program["kind"] == "test module":
                record["where"] = f"{program['page']}:{program['blocks'][0]['line']}"
                _run_test_module(program)
            else:
                _run_script(program, rank, record)
        except BaseException as error:  # a block that calls sys.exit() fails too
            record["error"] = _traceback_from_the_page(error)
        record["seconds"] = round(time.perf_counter() - started, 2)  # to find slow pages
        with open(out / f"rank{rank}.jsonl", "a") as report:
            report.write(json.dumps(record) + "\n")
        if "error" in record:
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
