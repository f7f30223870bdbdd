"""``Graph.config.enable_compile``: each stage's forward compiled with ``torch.compile``.

# NOTE [compiled stages]
# What a graph compiles is each pipeline stage's module ``forward`` on the
# ranks of its placement (with no stages: each module assigned to the graph).
# The compiled forward is set as the module's instance attribute ``forward``,
# so ``module(x)`` still runs the module's hooks eagerly (the pipeline runtime
# parks interleaved micro-batches in a forward pre-hook) and then the compiled
# code; AOTAutograd compiles the matching backward. What stays eager is what a
# graph cannot hold: the transfers between stages (``to_global`` to the next
# placement, in ``build``), the loss, the schedule, gradient accumulation and
# the optimizer step. A rank outside a stage's placement does not run the stage
# in a pipelined step (NOTE [stages held elsewhere] in _held_elsewhere.py).
# ``enable_compile(False)`` puts the modules' own ``forward`` back.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["compile_forwards"]

_COMPILED = "_sbpflow_compiled_forward"  # (options it was compiled with, compiled forward)


def compile_forwards(modules: Sequence[torch.nn.Module], options: dict[str, Any] | None) -> None:
    """Give each module a forward compiled with ``options`` (None: its own forward again)."""
    for module in modules:
        compiled = module.__dict__.get(_COMPILED)
        if options is None:
            if compiled is not None:
                del module.__dict__["forward"], module.__dict__[_COMPILED]
            continue
        if compiled is not None and compiled[0] == options:
            continue  # compiled already, with these options
        eager = type(module).forward.__get__(module)
        forward = torch.compile(eager, **options)
        module.__dict__["forward"] = forward
        module.__dict__[_COMPILED] = (dict(options), forward)
