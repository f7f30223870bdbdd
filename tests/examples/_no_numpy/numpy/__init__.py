"""Stands in for numpy in the example runs: importing it fails as on a machine without numpy."""

raise ModuleNotFoundError("No module named 'numpy' (hidden by tests/examples)", name="numpy")
