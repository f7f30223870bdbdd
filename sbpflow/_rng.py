"""The random state of the logical program: one seed and one offset, the same on every rank.

# NOTE [logical random state]
# Every rank runs the same program, so a random op on a global tensor is the
# same call on every rank; but a rank outside the op's placement skips the
# computation (its piece is empty), and local
# code (data augmentation, a sampler) advances torch's per-process generator
# differently on each rank. Drawing from torch's generator would let the ranks
# fall out of step silently. So, as DTensor's offset-based tracker does, global
# randomness draws from a state of its own, never from torch's default generator:
#
#   seed    set by ``sbpflow.manual_seed`` (0 until then);
#   offset  how many random values the logical program has drawn so far.
#
# A random op whose first tensor argument has ``n`` logical elements reads
# positions ``offset .. offset + n - 1`` and advances ``offset`` by ``n`` on
# EVERY rank, inside its placement or not (the dispatcher calls ``skip`` where
# it skips the op). What the values at those positions are is the op's business:
# - factories (``sbpflow.randn``) hash (seed, position) per element, so a rank
#   computes only its slice (NOTE [counter-based random] in _factories.py);
# - torch's kernels (dropout, ``bernoulli_``, ``normal_``, ...) draw the whole
#   logical tensor with a ``torch.Generator`` seeded by ``stream_seed(seed,
#   offset)`` and keep this rank's piece: broadcast ranks get the same values,
#   split ranks slices of one draw (see NOTE [random ops] in ops/nn_random.py).
# A call given an explicit ``generator=`` uses it as given and leaves the state
# alone: keeping that generator in step across ranks is then the caller's job.
#
# NOTE [recomputed randomness]
# Activation checkpointing runs a region's forward again in the backward and
# relies on the random state being restored first: torch.utils.checkpoint saves
# and restores torch's generators, not this state. A recomputed dropout would
# then read new positions and draw another mask: the gradient of a mask the
# forward never used, silently. So a draw from the program's state while a
# backward pass runs raises (``take``), and ``checkpoint_contexts`` is the
# ``context_fn`` that makes recomputation exact: its forward context notes the
# position the region starts at, its recompute context replays from there on a
# stream of its own.
#
# NOTE [random streams]
# Code that runs several calls of a program's work interleaved, or in an order
# that may change, can keep the values each call draws independent of that
# order: it gives each call a ``RandomStream`` of its own (a seed, positions
# from 0), set with ``set_stream`` in the ``contextvars.Context`` the call's work
# runs in, so the stream follows the work onto whatever thread runs it. Random
# ops in that context draw from the stream instead of the program's state; the
# caller then moves the program's state past what the streams drew
# (``advance``), so the program goes on as every rank's does.
"""

from __future__ import annotations

import contextvars
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch._subclasses.fake_tensor import UnsupportedFakeTensorException
from torch.utils._pytree import tree_flatten

from . import _global
from ._compiling import compiling

__all__ = [
    "RandomOpInBackward",
    "RandomStream",
    "advance",
    "checkpoint_contexts",
    "current_stream",
    "draw_numel",
    "draws",
    "generator",
    "manual_seed",
    "next_generator",
    "position",
    "set_stream",
    "skip",
    "state",
    "stream_seed",
    "take",
]

_MASK64 = (1 << 64) - 1
_seed = 0
_offset = 0
_generators: dict[torch.device, torch.Generator] = {}

# Random ops whose schema has no ``generator`` argument (native_dropout draws unless train=False).
_DRAWS_WITHOUT_GENERATOR = {
    torch.ops.aten.native_dropout.default,
    torch.ops.aten.randint_like.default,
    torch.ops.aten.randint_like.low_dtype,
}


def manual_seed(seed: int) -> None:
    """Seed sbpflow's global randomness (and torch's own generator, for local code).

    Every rank must pass the same seed: random global tensors and dropout masks
    then depend only on it and on the program, never on placements or SBPs.
    """
    global _seed, _offset
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise TypeError(f"manual_seed takes an int, got {type(seed).__name__}.")
    _seed, _offset = seed & _MASK64, 0
    torch.manual_seed(seed)


def state() -> tuple[int, int]:
    """``(seed, offset)``: where the logical program's next random op reads."""
    return _seed, _offset


class RandomOpWhileTracing(UnsupportedFakeTensorException):
    """A random op met while torch.compile traces (NOTE [compiled global tensors]).

    The fake-tensor exception Dynamo answers with a graph break, running the op eagerly
    between two graphs; it does so on every supported torch. Any other exception there fails
    the compile (and an exception raised while Dynamo formats it, e.g. reading a fake value,
    would turn into a break by accident).
    """

    def __str__(self) -> str:
        return self.reason


class RandomOpInBackward(RuntimeError):
    """A random op on a global tensor drew while a backward pass ran, outside any replay
    (NOTE [recomputed randomness])."""


_IN_BACKWARD = (
    "sbpflow: a random op on a global tensor (dropout with p > 0, bernoulli, normal_, ...) ran "
    "during a backward pass: in the recomputation of activation checkpointing, or in a hook "
    "or a custom backward. "
    "sbpflow's random state is not torch's generator, which torch.utils.checkpoint restores, "
    "so the recomputation would draw a different mask than the forward did and the "
    "gradients would be wrong. Checkpoint with "
    "`torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False, "
    "context_fn=sbpflow.utils.checkpoint_contexts)` (Hugging Face: "
    "`model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={'use_reentrant': "
    "False, 'context_fn': sbpflow.utils.checkpoint_contexts})`), which replays the forward's "
    "draws, or keep random ops out of checkpointed regions; draw a hook's random values "
    "before the backward, or on plain tensors with your own generator."
)


@dataclass
class RandomStream:
    """The random positions of one call's work (NOTE [random streams])."""

    seed: int
    offset: int = 0


_stream: contextvars.ContextVar[RandomStream | None] = contextvars.ContextVar(
    "sbpflow_random_stream", default=None
)


def set_stream(stream: RandomStream | None) -> None:
    """Draw from ``stream`` in the current ``contextvars.Context`` (None: the program's state)."""
    _stream.set(stream)


class _Replay:
    """Where a checkpointed region's forward drew, and a context replaying it
    (NOTE [recomputed randomness]). Reusable: a retained graph recomputes again."""

    def __init__(self) -> None:
        self.start: tuple[int, int] | None = None
        self._tokens: list[contextvars.Token[RandomStream | None]] = []

    def record(self) -> _Record:
        return _Record(self)

    def __enter__(self) -> None:
        if self.start is None:
            raise RuntimeError("sbpflow: a checkpointed region recomputed before its forward ran.")
        self._tokens.append(_stream.set(RandomStream(*self.start)))

    def __exit__(self, *exc: object) -> None:
        _stream.reset(self._tokens.pop())


class _Record:
    """The forward context of a checkpointed region: notes where its first draw reads."""

    def __init__(self, replay: _Replay) -> None:
        self._replay = replay

    def __enter__(self) -> None:
        self._replay.start = position()

    def __exit__(self, *exc: object) -> None:
        return None


def checkpoint_contexts() -> tuple[Any, Any]:
    """``context_fn`` for ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``:
    the recomputation draws the same random values as the forward did.

    The forward context notes the logical random position where the region starts; the
    recompute context draws from a stream starting there (NOTE [random streams]), so a
    dropout mask recomputed in the backward is the forward's mask, and the program's own
    random state is not moved a second time. Returns ``(forward_context, recompute_context)``
    as ``context_fn`` must.
    """
    replay = _Replay()
    return replay.record(), replay


def current_stream() -> RandomStream | None:
    """The stream the current ``contextvars.Context`` draws from, if any."""
    return _stream.get()


def advance(numel: int) -> None:
    """Move the program's state past ``numel`` positions (what a step's streams drew)."""
    global _offset
    _offset += numel


def position() -> tuple[int, int]:
    """``(seed, offset)`` where the next random op in this context reads (its stream's, if any)."""
    stream = _stream.get()
    if stream is not None:
        return stream.seed, stream.offset
    return _seed, _offset


def take(numel: int) -> tuple[int, int]:
    """Claim ``numel`` positions for one random op; return ``(seed, offset)`` of the first."""
    global _offset
    if compiling():
        raise RandomOpWhileTracing(
            "sbpflow: a random op on a global tensor (bernoulli, normal_, "
            "sbpflow.randn, ...) cannot be traced into a torch.compile graph: sbpflow's logical "
            "random state advances in Python, which a compiled graph would freeze. torch.compile "
            "breaks the graph and runs it eagerly; with fullgraph=True, call it outside the "
            "compiled function, or compile the model in eval() mode / with dropout p=0."
        )
    stream = _stream.get()
    if stream is not None:
        start = stream.offset
        stream.offset += numel
        return stream.seed, start
    if torch._C._current_graph_task_id() != -1:
        raise RandomOpInBackward(_IN_BACKWARD)
    start = _offset
    _offset += numel
    return _seed, start


def _splitmix64(x: int) -> int:
    # Steele, Lea & Flood's SplitMix64 finaliser (the constants are theirs).
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def stream_seed(seed: int, offset: int) -> int:
    """The seed of the ``torch.Generator`` a kernel draws with at ``offset`` (63 bits)."""
    return _splitmix64(_splitmix64(seed) ^ (offset & _MASK64)) >> 1


def generator(seed: int, offset: int, device: torch.device) -> torch.Generator:
    """A generator on ``device`` seeded for the draw at ``(seed, offset)``.

    One generator per device is kept and reseeded (seeding costs microseconds).
    """
    gen = _generators.get(device)
    if gen is None:
        gen = _generators[device] = torch.Generator(device=device)
    return gen.manual_seed(stream_seed(seed, offset))


def draws(func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> bool:
    """Whether this ATen call draws from the logical state (a random op, no own generator)."""
    schema = getattr(func, "_schema", None)
    if schema is None:
        return False
    if func in _DRAWS_WITHOUT_GENERATOR:
        return _argument(schema, args, kwargs, "train", True) is not False  # True if no train
    if not any(a.name == "generator" and "Generator" in str(a.type) for a in schema.arguments):
        return False
    return _argument(schema, args, kwargs, "generator", None) is None


def _argument(
    schema: Any, args: Sequence[Any], kwargs: dict[str, Any], name: str, default: Any
) -> Any:
    for i, a in enumerate(schema.arguments):
        if a.name == name:
            if i < len(args) and not a.kwarg_only:
                return args[i]
            return kwargs.get(name, default)
    return default


def draw_numel(args: Sequence[Any], kwargs: dict[str, Any]) -> int:
    """Positions a random op takes: the logical numel of its first tensor argument.

    A plain 0-dim tensor is skipped, as the dispatcher does when it promotes
    plain tensors to broadcast globals.
    """
    for a in tree_flatten((list(args), kwargs))[0]:
        if isinstance(a, torch.Tensor) and (a.dim() > 0 or isinstance(a, _global.GlobalTensor)):
            return math.prod(a.shape)
    return 0


def next_generator(args: Sequence[Any], kwargs: dict[str, Any], device: torch.device) -> Any:
    """The generator for a random op's next draw (claiming its positions)."""
    return generator(*take(draw_numel(args, kwargs)), device)


def skip(func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> None:
    """Advance the state as ``func`` would on a rank that runs it (for ranks that skip it)."""
    if draws(func, args, kwargs):
        take(draw_numel(args, kwargs))
