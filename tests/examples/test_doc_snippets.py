"""Every Python block in README.md and docs/*.md runs as written.

How a block runs is marked on the page (see ``_doc_blocks``): a plain block is a script run
as ``python script.py`` (a world of one), ``<!-- run: launch N -->`` runs it on N ranks
through ``python -m sbpflow.distributed.launch``, ``<!-- run: continues -->`` carries on the
previous block's program, ``<!-- run: output -->`` on a ```text block compares what the
program printed on rank 0 with what the page shows, ``<!-- run: signature -->`` blocks
(API signatures) are compared with the code, and ``<!-- run: skip (why) -->`` blocks are compiled and reported as skipped with
their reason. The programs of every page run in one set of processes per number of ranks
(one launch, not one per page or block); a failing program is reported under its page with
its block's line and every rank's traceback, and the launch resumes after it.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from tests.examples._doc_blocks import (
    ROOT,
    Block,
    MarkError,
    Program,
    pages,
    parse_page,
    programs,
    read_page,
)
from tests.examples._doc_runner import matches
from tests.examples._doc_signatures import differences

TIMEOUT_S = 300  # one launch runs every program for its number of ranks
COLLECTIVE_TIMEOUT_S = "60"  # a block that leaves ranks waiting fails instead of hanging


def _read_all() -> tuple[list[Block], list[Program], list[str]]:
    """Every page's blocks and programs, and the marks that could not be followed."""
    blocks: list[Block] = []
    page_programs: list[Program] = []
    problems: list[str] = []
    for path in pages():
        try:
            page_blocks = read_page(path)
            page_programs += programs(page_blocks)
        except MarkError as error:
            problems.append(str(error))
            continue
        blocks += page_blocks
    return blocks, page_programs, problems


BLOCKS, PROGRAMS, MARK_PROBLEMS = _read_all()
RUN_PAGES = list(dict.fromkeys(p.page for p in PROGRAMS))
SIGNATURES = [b for b in BLOCKS if b.kind == "signature"]
SKIPPED = [b for b in BLOCKS if b.kind == "skip"]


def test_marks_are_valid() -> None:
    assert not MARK_PROBLEMS, "\n".join(MARK_PROBLEMS)
    assert len(BLOCKS) > 40 and RUN_PAGES, "the pages' Python blocks were not found"


# --- running the programs ----------------------------------------------------------------


def _env(tmp: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env["SBPFLOW_CACHE_DIR"] = str(tmp / "cache")  # plan with the default costs
    env["SBPFLOW_TIMEOUT"] = COLLECTIVE_TIMEOUT_S
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    return env


def _launch(plan: Path, out: Path, start: int, ranks: int) -> tuple[int, str]:
    """Run programs ``start..`` of ``plan`` on ``ranks`` ranks; (exit status, output)."""
    runner = ["-m", "tests.examples._doc_runner", str(plan), str(out), str(start)]
    if ranks == 1:
        argv = [sys.executable, *runner]
    else:
        launch = ["-m", "sbpflow.distributed.launch", "--nproc_per_node", str(ranks)]
        argv = [sys.executable, *launch, *runner]
    out.mkdir(parents=True)
    process = subprocess.Popen(
        argv,
        cwd=out,
        env=_env(out),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # so a timeout can stop the launcher and every rank
    )
    try:
        output, _ = process.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        return -1, f"{output}\n(stopped after {TIMEOUT_S} s)"
    return process.returncode, output


def _reports(out: Path) -> list[dict[str, Any]]:
    records = []
    for path in sorted(out.glob("rank*.jsonl")):
        rank = int(path.stem[len("rank") :])
        records += [{"rank": rank, **json.loads(line)} for line in path.read_text().splitlines()]
    return records


def _run(group: list[Program], ranks: int, tmp: Path) -> dict[int, str]:
    """Run ``group`` (all on ``ranks`` ranks); {index in group: why it failed}."""
    plan = tmp / f"plan-{ranks}.json"
    plan.write_text(
        json.dumps(
            [
                {
                    "page": p.page,
                    "kind": p.kind,
                    "workdir": p.workdir or p.page,
                    "blocks": [
                        {"line": b.line, "code": b.code, "expected_output": b.expected_output}
                        for b in p.blocks
                    ],
                }
                for p in group
            ]
        )
    )
    failures: dict[int, str] = {}
    start = 0
    while start < len(group):
        status, output = _launch(plan, tmp / f"ranks{ranks}-from{start}", start, ranks)
        if status == 0:
            break
        records = _reports(tmp / f"ranks{ranks}-from{start}")
        errors = [r for r in records if "error" in r]
        how = f"on {ranks} rank{'s' * (ranks > 1)}"
        if errors:
            first = min(r["index"] for r in errors)
            ranks_by_error: dict[tuple[str, str], list[int]] = defaultdict(list)
            for r in sorted(errors, key=lambda r: r["rank"]):
                if r["index"] == first:  # the same error on several ranks is shown once
                    ranks_by_error[r["where"], r["error"]].append(r["rank"])
            failures[first] = "\n".join(
                f"{where} raised {how} (rank {', '.join(map(str, on))}):\n{error}"
                for (where, error), on in ranks_by_error.items()
            )
        else:  # the processes ended (or were stopped) with no report: a crash or a hang
            done = {r["index"] for r in records}
            first = min(set(range(start, len(group))) - done)
            failures[first] = (
                f"{group[first].where} did not finish {how} (exit status {status}); "
                f"the run's output ends with:\n{output[-4000:]}"
            )
        start = first + 1
    return failures


def _run_programs(programs: list[Program], tmp: Path) -> dict[str, list[str]]:
    """Run ``programs``, one launch per number of ranks; {page: why each failing one failed}.

    The launches for different numbers of ranks run at the same time: each has its own
    directories and rendezvous port, and a launch of one rank (a plain process, mostly
    compiling) leaves cores idle that the others use."""
    by_ranks: dict[int, list[Program]] = defaultdict(list)
    for program in programs:
        by_ranks[program.ranks].append(program)
    groups = sorted(by_ranks.items())
    with ThreadPoolExecutor(max_workers=max(1, len(groups))) as launches:
        failures = list(launches.map(lambda item: _run(item[1], item[0], tmp), groups))
    result: dict[str, list[str]] = defaultdict(list)
    for (_, group), failed in zip(groups, failures, strict=True):
        for index, why in sorted(failed.items()):
            result[group[index].page].append(why)
    return result


@pytest.fixture(scope="module")
def failures_by_page(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, list[str]]:
    """Runs the programs of every page selected for this session (all of them by default)."""
    selected = {
        item.callspec.params["page"]
        for item in request.session.items
        if isinstance(item, pytest.Function) and item.originalname == "test_page_runs"
    }
    wanted = [p for p in PROGRAMS if p.page in selected]
    return _run_programs(wanted, tmp_path_factory.mktemp("doc-snippets"))


@pytest.mark.parametrize("page", RUN_PAGES)
def test_page_runs(page: str, failures_by_page: dict[str, list[str]]) -> None:
    failures = failures_by_page.get(page, [])
    assert not failures, "\n\n".join(failures)


# --- blocks that are not run ---------------------------------------------------------------


@pytest.mark.parametrize("block", SKIPPED, ids=[b.where for b in SKIPPED])
def test_skipped_block(block: Block) -> None:
    """A skipped block still has to be valid Python; the skip and its reason are reported."""
    compile(block.code, f"{ROOT / block.page}:{block.line}", "exec")
    pytest.skip(f"{block.where} is not run: {block.reason}")


@pytest.mark.parametrize("block", SIGNATURES, ids=[b.where for b in SIGNATURES])
def test_signature_matches_code(block: Block) -> None:
    """Each documented signature has the parameters (names, kinds, defaults) of the code."""
    problems = differences(block.code)
    assert not problems, f"{block.where}: signatures differ from the code\n" + "\n".join(problems)


# --- the harness itself ---------------------------------------------------------------------

_MARKED_PAGE = """
<!-- run: launch 2 as first -->
```python
a = 1
```
```python
b = 2
```
<!-- run: continues -->
```python
c = b
```
<!-- run: output -->
```text
2
```
<!-- run: continues first -->
```python
d = a
```
<!-- run: skip (needs CUDA) -->
```python
e = 1
```
<!-- run: signature -->
```python
f(x) -> int
```
```bash
echo not python
```
"""


def test_marks_group_blocks_into_programs() -> None:
    """Each mark of the page above lands where ``_doc_blocks``' docstring says."""
    blocks = parse_page("p.md", _MARKED_PAGE)
    assert [(b.line, b.kind, b.ranks, b.reason) for b in blocks] == [
        (3, "script", 2, ""),
        (6, "script", 1, ""),
        (10, "continues", 1, ""),
        (18, "continues", 1, ""),
        (22, "skip", 1, "needs CUDA"),
        (26, "signature", 1, ""),
    ]
    assert blocks[2].expected_output == "2\n"
    grouped = programs(blocks)
    assert [(p.ranks, [b.line for b in p.blocks]) for p in grouped] == [(2, [3, 18]), (1, [6, 10])]


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("<!-- run: launch four -->\n```python\n```\n", "unknown mark `run: launch four`"),
        ("<!-- run: skip -->\n```python\n```\n", "unknown mark `run: skip`"),
        ("<!-- run: continues -->\n```python\n```\n", "follows no a script"),
        ("```python\n```\n<!-- run: continues x -->\n```python\n```\n", "named 'x'"),
        ("<!-- run: launch 2 -->\n\n```python\n```\n", "right above a fence"),
        ("<!-- run: launch 2 -->\n```bash\n```\n", "is on a ```bash block"),
        ("<!-- run: output -->\n```text\n```\n", "must follow a Python block that runs"),
    ],
)
def test_a_mark_the_test_cannot_follow_is_an_error(text: str, problem: str) -> None:
    with pytest.raises(MarkError, match=re.escape(problem)):
        programs(parse_page("p.md", text))


def test_a_signature_that_is_not_the_code_is_reported() -> None:
    randn = "sbpflow.randn(*size, placement, sbp, dtype=None, requires_grad={}) -> GlobalTensor"
    assert differences(randn.format("False")) == []
    (problem,) = differences(randn.format("True"))
    assert "('requires_grad', 'KEYWORD_ONLY', 'True')" in problem
    assert "('requires_grad', 'KEYWORD_ONLY', 'False')" in problem


def test_shown_output_matches_with_ellipsis() -> None:
    assert matches("a ~... ms\nb", "a ~2.5 ms  \nb\n\n")
    assert matches("x\n...\nz", "x\ny1\ny2\nz")
    assert not matches("a ~... ms\nb", "a ~2.5 ms\nc")
    assert not matches("P", "(P,)")


def test_a_failing_block_is_reported_with_its_page_line_and_error(tmp_path: Path) -> None:
    """Two broken programs on a page: both are reported (the run goes on after the first),
    each naming the page, its block's line and what went wrong."""
    page = "```python\nx = 1\nprint(undefined_name)\n```\n\n```python\nprint(2)\n```\n"
    page += "<!-- run: output -->\n```text\n3\n```\n"
    failures = _run_programs(programs(parse_page("broken.md", page)), tmp_path)
    assert list(failures) == ["broken.md"] and len(failures["broken.md"]) == 2
    name_error, wrong_output = failures["broken.md"]
    assert "broken.md:1 raised on 1 rank" in name_error
    assert 'broken.md", line 3' in name_error
    assert "NameError: name 'undefined_name' is not defined" in name_error
    assert "broken.md:6 printed\n2\n\nbut the page shows\n3" in wrong_output
