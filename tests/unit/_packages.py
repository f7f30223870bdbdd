"""A throwaway Python package on disk, for tests of checkers that read a package's source."""

from __future__ import annotations

from pathlib import Path


def write_package(root: Path, modules: dict[str, str], name: str = "pkg") -> Path:
    """``root/name`` with an ``__init__.py`` (empty unless given) and one file per module."""
    package = root / name
    package.mkdir()
    files = {"__init__": "", **modules}
    for module, source in files.items():
        (package / f"{module}.py").write_text(source)
    return package
