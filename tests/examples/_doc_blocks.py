"""The Python blocks of README.md and docs/*.md, and how each one runs (pure: no processes).

A page marks a block with an HTML comment on the line right above its fence (GitHub does not
render it, so the page stays readable)::

    (no mark)                   a script of its own, run as `python script.py`: a world of one
    <!-- run: launch N -->      a script of its own, run on N ranks by
                                `python -m sbpflow.distributed.launch --nproc_per_node N`
    <!-- run: continues -->     more of the page's latest program (same names, same ranks)
    <!-- run: launch N as X --> ... a script named X, which a later block continues with
    <!-- run: continues X -->   (when another program comes in between)
    <!-- run: skip (why) -->    not run (it cannot run here, e.g. it needs CUDA); still compiled,
                                and listed with its reason in the test report
    <!-- run: signature -->     API signatures: each line's parameters (names, kinds, defaults)
                                must be those of the object it names
    <!-- run: test module -->   a test file: saved as a module, and its test_* functions called

and a ```text block that shows what the Python block above it printed (on rank 0) with::

    <!-- run: output -->        the printed text must match it (`...` stands for any text)
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

_FENCE = re.compile(r"^(?P<indent>\s*)```(?P<lang>[\w-]*)\s*$")
_MARK = re.compile(r"^\s*<!--\s*run:\s*(?P<mark>.*?)\s*-->\s*$")
_LAUNCH = re.compile(r"launch (?P<ranks>[1-9]\d*)(?: as (?P<name>\w+))?")
_CONTINUES = re.compile(r"continues(?: (?P<name>\w+))?")
_SKIP = re.compile(r"skip \((?P<reason>.+)\)")
_PLAIN_MARKS = ("signature", "test module")


def pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


@dataclass
class Block:
    """One ```python block: where it is, its code, how it runs, and the output it shows."""

    page: str  # path from the repository root
    line: int  # 1-based line of the opening fence
    code: str
    kind: str  # "script", "continues", "skip", "signature" or "test module"
    ranks: int = 1  # for a script: 1 runs it plainly, more through the launcher
    name: str = ""  # a script's name, or the named script a block continues
    reason: str = ""  # for "skip"
    expected_output: str | None = None  # a following ```text block marked `run: output`

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"


@dataclass
class Program:
    """A script block and the blocks that continue it (one namespace, one set of ranks), or a
    test module (run by a world of one; its tests start their own ranks)."""

    page: str
    ranks: int
    blocks: list[Block] = field(default_factory=list)
    kind: str = "script"
    workdir: str = ""  # its working directory's name, when not its page's (shared by the page)

    @property
    def where(self) -> str:
        return self.blocks[0].where


class MarkError(ValueError):
    """A mark the test cannot follow: a typo, a mark with no fence, a continuation of nothing."""


def _fences(lines: list[str]) -> Iterator[tuple[int, str, str]]:
    """(index of the opening fence line, language, dedented body) for every fenced block."""
    i = 0
    while i < len(lines):
        opening = _FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        indent = len(opening["indent"])
        end = i + 1
        while end < len(lines) and lines[end].strip() != "```":
            end += 1
        body = "\n".join(line[indent:] for line in lines[i + 1 : end])
        yield i, opening["lang"], body + "\n"
        i = end + 1


def _mark_above(lines: list[str], index: int) -> str | None:
    if index == 0:
        return None
    found = _MARK.match(lines[index - 1])
    return found["mark"] if found else None


def read_page(path: Path) -> list[Block]:
    """Every ```python block of one page, with its mark; raises MarkError for a bad mark."""
    return parse_page(path.relative_to(ROOT).as_posix(), path.read_text())


def parse_page(page: str, text: str) -> list[Block]:
    """``read_page`` for the Markdown ``text`` of ``page`` (a path from the repository root)."""
    lines = text.splitlines()
    blocks: list[Block] = []
    used_marks: set[int] = set()
    for index, lang, body in _fences(lines):
        mark = _mark_above(lines, index)
        if mark is not None:
            used_marks.add(index - 1)
        where = f"{page}:{index + 1}"
        if lang == "text" and mark == "output":
            if not blocks or blocks[-1].kind not in ("script", "continues"):
                raise MarkError(f"{where}: `run: output` must follow a Python block that runs")
            blocks[-1].expected_output = body
            continue
        if lang != "python":
            if mark is not None:
                raise MarkError(f"{where}: `run: {mark}` is on a ```{lang} block")
            continue
        blocks.append(_block(page, index + 1, body, mark, where))
    for number, text in enumerate(lines):
        if _MARK.match(text) and number not in used_marks:
            raise MarkError(f"{page}:{number + 1}: a run mark must be right above a fence")
    return blocks


def _block(page: str, line: int, code: str, mark: str | None, where: str) -> Block:
    if mark is None:
        return Block(page, line, code, "script")
    if mark in _PLAIN_MARKS:
        return Block(page, line, code, mark)
    if launch := _LAUNCH.fullmatch(mark):
        ranks, name = int(launch["ranks"]), launch["name"] or ""
        return Block(page, line, code, "script", ranks=ranks, name=name)
    if continues := _CONTINUES.fullmatch(mark):
        return Block(page, line, code, "continues", name=continues["name"] or "")
    if skip := _SKIP.fullmatch(mark):
        return Block(page, line, code, "skip", reason=skip["reason"])
    raise MarkError(
        f"{where}: unknown mark `run: {mark}`; expected `launch N`, `launch N as NAME`, "
        "`continues`, `continues NAME`, `skip (why)`, `signature`, `test module` or, on a "
        "```text block, `output`"
    )


def programs(blocks: list[Block]) -> list[Program]:
    """Group a page's runnable blocks into programs; raises MarkError for a continuation of
    nothing or of an unknown name."""
    result: list[Program] = []
    named: dict[str, Program] = {}
    for block in blocks:
        if block.kind in ("script", "test module"):
            result.append(Program(block.page, block.ranks, [block], block.kind))
            if block.name:
                named[block.name] = result[-1]
        elif block.kind == "continues":
            target = named.get(block.name) if block.name else (result[-1] if result else None)
            if target is None or target.kind != "script":
                what = f"a script named {block.name!r}" if block.name else "a script"
                raise MarkError(f"{block.where}: `run: continues` follows no {what} on the page")
            target.blocks.append(block)
    return result
