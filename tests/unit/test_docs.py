"""The docs stay in step with the code: the generated op list and the links between pages.

No process group: the op list comes from the rule table, which is pure.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"


def test_ops_list_is_up_to_date() -> None:
    result = subprocess.run(
        [sys.executable, str(DOCS / "_gen_ops_list.py"), "--check"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr


def _anchors(markdown: str) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    out = set()
    for line in markdown.splitlines():
        heading = re.match(r"#+\s+(.*)", line)
        if heading:
            text = re.sub(r"[^\w\- ]", "", heading.group(1).strip().lower())
            out.add(text.replace(" ", "-"))
    return out


def test_relative_links_resolve() -> None:
    problems = []
    for page in [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if re.match(r"[a-z]+:", target):
                continue  # http(s):, mailto:
            path, _, anchor = target.partition("#")
            linked = (page.parent / path) if path else page
            if not linked.exists():
                problems.append(f"{page.name}: {target} (no such file)")
            elif anchor and linked.suffix == ".md" and anchor not in _anchors(linked.read_text()):
                problems.append(f"{page.name}: {target} (no such heading)")
    assert not problems, "\n".join(problems)
