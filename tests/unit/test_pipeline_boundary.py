"""The pipeline runtime stays in ``sbpflow/nn/pipeline/``: no module outside it imports from it
or names a pipeline concept, except those listed in ``ALLOWED`` with the reason each still does.

Checked from the source: every import (absolute or relative) that resolves into
``sbpflow.nn.pipeline``, and every identifier, string and comment (``tokenize``) that names a
concept of the pipeline (``CONCEPTS``). A new mention anywhere fails, and so does an entry of
``ALLOWED`` that no longer matches anything: the list only shrinks.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

import sbpflow

from ._packages import write_package

PACKAGE = Path(sbpflow.__file__).resolve().parent
INSIDE = "nn.pipeline"  # relative to the package

CONCEPTS = {
    "import": None,  # an import from the pipeline package
    "pipeline": r"pipelin",
    "stage": r"(?<![a-z])stages?(?![a-z])",
    "micro-batch": r"micro.?batch",
    "sit out": r"sit.?out",
    "lane": r"(?<![a-z])lanes?(?![a-z])",
    "early receive": r"early.?rec",
    "deferred": r"defer",
}

# module -> {concept: why it is still there}. None is a pipeline branch: the public face of
# sbpflow.nn, words of other meanings, and comments or an error message that name the pipeline
# to explain a general behaviour to the reader or to the user.
ALLOWED: dict[str, dict[str, str]] = {
    "sbpflow.nn": {
        "import": "the package's public face: sbpflow.nn.pipeline, Graph, Block",
        "pipeline": "its docstring and __all__ name the public subpackage",
        "stage": "its docstring says what Graph is for",
    },
    "sbpflow.checkpoint._save": {
        "stage": "a checkpoint stages a state dict before writing it (not a pipeline stage)",
    },
    "sbpflow.nn.parallel.sync": {
        "micro-batch": "gradient accumulation's micro-batches (no_sync), not the pipeline's",
    },
    "sbpflow.nn.parallel._reducer": {
        "pipeline": "a comment: pipelined micro-batches reach the reducer's hooks twice",
        "micro-batch": "gradient accumulation's micro-batches, not the pipeline's",
    },
    "sbpflow.nn.parallel.fsdp": {
        "pipeline": "an error message naming how to shard a stage that lives on some ranks",
        "stage": "the same error message",
    },
    "sbpflow.ops.optim": {
        "pipeline": "a comment giving stages as an example of a placement no op used",
        "stage": "the same comment",
    },
}


def _module_name(package: Path, path: Path) -> str:
    parts = [package.name, *path.relative_to(package).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _resolved_imports(tree: ast.AST, module: str, is_package: bool) -> set[str]:
    """The absolute name of every module an import statement names (at any depth)."""
    names: set[str] = set()
    here = module.split(".") if is_package else module.split(".")[:-1]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here[: len(here) - node.level + 1]
                prefix = ".".join(base + ([node.module] if node.module else []))
            else:
                prefix = node.module or ""
            names.add(prefix)
            names.update(f"{prefix}.{alias.name}" for alias in node.names)
    return names


def _words(text: str) -> list[str]:
    """Identifiers, strings and comments of a module's source, lower case, ``_`` as a space."""
    out = []
    for token in tokenize.generate_tokens(io.StringIO(text).readline):
        if token.type in (tokenize.NAME, tokenize.STRING, tokenize.COMMENT):
            out.append(token.string.lower().replace("_", " "))
    return out


def pipeline_mentions(package: Path) -> dict[str, set[str]]:
    """Per module outside the pipeline package, the pipeline concepts it imports or names."""
    inside = f"{package.name}.{INSIDE}"
    found: dict[str, set[str]] = {}
    for path in sorted(package.rglob("*.py")):
        module = _module_name(package, path)
        if module == inside or module.startswith(inside + "."):
            continue
        text = path.read_text()
        concepts: set[str] = set()
        imported = _resolved_imports(ast.parse(text), module, path.name == "__init__.py")
        if any(name == inside or name.startswith(inside + ".") for name in imported):
            concepts.add("import")
        words = _words(text)
        for concept, pattern in CONCEPTS.items():
            if pattern is not None and any(re.search(pattern, w) for w in words):
                concepts.add(concept)
        if concepts:
            found[module] = concepts
    return found


def test_only_the_listed_modules_name_the_pipeline() -> None:
    found = pipeline_mentions(PACKAGE)
    new = {m: sorted(c - set(ALLOWED.get(m, {}))) for m, c in found.items()}
    new = {m: c for m, c in new.items() if c}
    assert not new, (
        "these modules outside sbpflow/nn/pipeline/ import from it or name a pipeline concept; "
        f"keep the pipeline's concerns in its package (issue 36): {new}"
    )
    stale = {m: sorted(set(c) - found.get(m, set())) for m, c in ALLOWED.items()}
    stale = {m: c for m, c in stale.items() if c}
    assert not stale, f"these entries of ALLOWED match nothing any more; remove them: {stale}"


def test_a_module_naming_the_pipeline_is_found(tmp_path: Path) -> None:
    """Each kind of mention is caught, in code, strings and comments, and through relative
    imports; the pipeline package itself and unrelated words are left alone."""
    package = write_package(tmp_path, {"core": "x = 1\n", "clean": "staged = 'planes'\n"})
    nn = package / "nn"
    (nn / "pipeline").mkdir(parents=True)
    (nn / "__init__.py").write_text("")
    (nn / "pipeline" / "__init__.py").write_text("pipeline_stage = 1\n")
    (nn / "other.py").write_text("from .pipeline import pipeline_stage\n")
    (package / "core.py").write_text(
        "import pkg.nn.pipeline\n"
        "def run(lane):  # the early receive of a micro-batch\n"
        "    return 'sit out'\n"
        "class DeferredSends:\n    pass\n"
        "stages = []\n"
    )
    found = pipeline_mentions(package)
    assert found == {
        "pkg.core": {
            "import",
            "pipeline",
            "lane",
            "early receive",
            "micro-batch",
            "sit out",
            "deferred",
            "stage",
        },
        "pkg.nn.other": {"import", "pipeline", "stage"},
    }
