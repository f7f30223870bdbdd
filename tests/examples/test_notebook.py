"""``examples/boxing_plans.ipynb`` runs top to bottom in a fresh kernel, with no process group.

The notebook builds and prints plans only (pure code), so it needs no ranks;
a stored calibration of this machine is kept out of it with an empty cache
directory, so it prints the default costs. With the ``notebook`` extra installed
(matplotlib; the ``test`` extra brings it too) it draws the planner's search
graph: a PNG image among its outputs.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

_ROOT = Path(__file__).resolve().parents[2]
_NOTEBOOK = _ROOT / "examples" / "boxing_plans.ipynb"


def _text(cell: dict) -> str:
    parts = []
    for output in cell.get("outputs", []):
        if "text" in output:
            parts.append(output["text"])
        parts.extend(
            str(v) for k, v in output.get("data", {}).items() if k in ("text/plain", "text/html")
        )
    return "\n".join(parts)


def test_boxing_plans_notebook_runs(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
    monkeypatch.setenv("PYTHONPATH", str(_ROOT))  # import sbpflow from this checkout
    monkeypatch.setenv("SBPFLOW_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("MPLBACKEND", raising=False)  # the kernel's inline backend draws
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    nb = nbformat.read(_NOTEBOOK, as_version=4)
    client = nbclient.NotebookClient(
        nb,
        timeout=60,
        kernel_name="python3",
        resources={"metadata": {"path": str(_NOTEBOOK.parent)}},
    )
    client.execute()  # raises CellExecutionError naming the failing cell

    outputs = "\n".join(_text(cell) for cell in nb.cells if cell.cell_type == "code")
    assert "S(0) -> B  on placement('cpu', [0, 1, 2, 3])" in outputs
    assert "all_gather" in outputs and "send_recv" in outputs
    assert "<table" in outputs  # the plan and the layout drew themselves as HTML
    assert "(S(0), S(1)) of shape [8, 12]" in outputs

    images = [
        output["data"]["image/png"]
        for cell in nb.cells
        if cell.cell_type == "code"
        for output in cell.get("outputs", [])
        if "image/png" in output.get("data", {})
    ]
    assert "matplotlib is not installed" not in outputs, (
        "the notebook could not draw its search graph: install the notebook extra "
        '(pip install -e ".[notebook]"; the test extra brings matplotlib too)'
    )
    assert len(images) == 1 and len(images[0]) > 1000, f"expected one drawn graph, got {images}"


def _extras() -> dict[str, list[str]]:
    """``extras_require`` as setup.py writes it."""
    tree = ast.parse((_ROOT / "setup.py").read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.keyword) and node.arg == "extras_require":
            return ast.literal_eval(node.value)
    raise AssertionError("setup.py has no extras_require")


def test_the_notebook_extra_brings_what_the_notebook_needs() -> None:
    """``pip install -e ".[notebook]"`` (docs/boxing-plans.md) installs matplotlib and the kernel
    that runs the notebook, and the test extra has them all (this test file needs them)."""
    extras = _extras()
    needed = {"matplotlib", "nbclient", "nbformat", "ipykernel"}
    assert needed <= set(extras.get("notebook", [])), extras.get("notebook")
    assert needed <= set(extras["test"]), extras["test"]
