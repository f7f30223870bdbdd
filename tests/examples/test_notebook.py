"""``examples/boxing_plans.ipynb`` runs top to bottom in a fresh kernel, with no process group.

The notebook builds and prints plans only (pure code), so it needs no ranks;
a stored calibration of this machine is kept out of it with an empty cache
directory, so it prints the default costs.
"""

from __future__ import annotations

from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

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
    monkeypatch.setenv("PYTHONPATH", str(_ROOT))  # import sbpflow from this checkout
    monkeypatch.setenv("SBPFLOW_CACHE_DIR", str(tmp_path))
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
