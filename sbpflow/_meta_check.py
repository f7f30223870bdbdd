"""Making the ranks agree on a conversion's metadata, in bounded time.

# NOTE [meta check]
# A rank that disagrees with the others (another shape, dtype, SBP or
# placement) would enter a different collective and hang the job. So each
# user-level ``to_global`` first makes one small, fixed-size collective over
# the whole world's gloo group (NOTE [meta check collectives]):
#   - local -> global (``exchange``) gathers one int64 vector per rank: its
#     dtype, shape, hashes of placement and SBP, and whether it already found
#     an error in its own arguments (shapes may differ by rank, and the
#     logical shape is computed from the gathered ones);
#   - global -> global (``agree``) only needs to know whether every rank holds
#     the same vector, so it exchanges one hash of it.
# Every rank sees the same gathered values and so reaches the same verdict; on
# any mismatch a second round gathers readable descriptions and every rank
# raises the same ``ValueError``. Nothing hangs: the collectives are
# fixed-size and bounded by the collective timeout (SBPFLOW_TIMEOUT).
#
# NOTE [call agreement]
# Every user-level call that communicates (``to_global``; reading a global
# tensor's value: ``item()``, ``tolist()``, ``print``) starts with the same
# collective, ``agree``: an all_reduce of two int64 over the control group
# (NOTE [control group]) of a hash of the call's name, the user's line making
# it, and the metadata that must match. Two ranks in different calls (rank 0 in
# ``loss.item()`` under ``if rank == 0`` while rank 1 went on to ``to_global``)
# so enter the same collective, see different hashes and raise the same
# ``CollectiveError`` at once, naming each rank's call and line, instead of
# pairing unrelated collectives (which gloo answers by aborting the process, or
# worse, by completing them with each other's data). The line is in the hash
# for that last reason: two ranks reading different tensors of one shape at
# two lines would otherwise each get a mix of both. Before the all_reduce each
# rank publishes its call on the store (NOTE [what the ranks were doing]) for
# the errors that are timeouts: a peer that went on to an op's boxing, or to
# code that never calls sbpflow again.
# Cost per call (bench/meta_check/run.py, 2 gloo ranks on one busy 2-core
# host, min / median): finding the user's line 1 / 1 us, publishing it 3 / 8 us
# (a ``set`` waits for no reply), next to 140-210 / 250-350 us for the
# all_reduce itself, which ``agree`` made before as well. A local -> global
# ``to_global`` now makes two collectives (the agreement, then the all_to_all
# of shapes): about twice the time of the single all_to_all it made before.
"""

from __future__ import annotations

import contextvars
import functools
import hashlib
from dataclasses import dataclass

import torch

from .comm import collectives
from .comm._errors import CollectiveError, publish, user_site
from .comm._world import get_rank, get_world_size

# NOTE [boxing agreement turned off]
# A caller that runs the work of several calls of one program interleaved (one
# rank in one call's forward while another runs an earlier call's backward)
# cannot let each ``to_global`` agree world-wide: the agreement would pair boxing
# calls of different program calls and make every rank wait for the slowest. It
# sets ``boxing_agreement`` to ``False`` in the ``contextvars.Context`` its work
# runs in, and boxing skips the agreement there. The ranks must then agree by
# construction (every rank runs the same program on the same inputs); a
# disagreement surfaces as a timeout naming each rank's call (NOTE [what the
# ranks were doing]) instead of a prompt error.
boxing_agreement: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "sbpflow_boxing_agreement", default=True
)

MAX_DIMS = 16
_HEADER = 8
_DTYPES = [
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
    torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128,
]  # fmt: skip


def stable_hash(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=7).digest(), "little")


@dataclass(frozen=True)
class RankMeta:
    """What one rank passed to a conversion."""

    error: str | None
    dtype: torch.dtype
    shape: tuple[int, ...]
    placement: str
    sbp: str
    in_placement: bool

    def encode(self) -> list[int]:
        header = [
            1 if self.error else 0,
            _DTYPES.index(self.dtype) if self.dtype in _DTYPES else 99,
            len(self.shape),
            stable_hash(self.placement),
            stable_hash(self.sbp),
            1 if self.in_placement else 0,
        ]
        dims = list(self.shape[:MAX_DIMS])
        return header + [0] * (_HEADER - len(header)) + dims + [0] * (MAX_DIMS - len(dims))

    @functools.cached_property
    def _encoded(self) -> list[int]:
        return self.encode()

    def encoded(self) -> list[int]:
        """``encode()``, computed once per ``RankMeta`` (never modified by the exchange)."""
        return self._encoded

    @functools.cached_property
    def digest(self) -> int:
        """A 56-bit hash of ``encode()``: equal vectors give equal digests, different ones (but with odds 2**-56) different."""
        return stable_hash(",".join(map(str, self._encoded)))


@functools.lru_cache(maxsize=4096)
def _call_hash(call: str, site: str) -> int:
    return stable_hash(f"{call} at {site}")


def _enter(call: str) -> tuple[str, int]:
    """Publish this rank's call; return the user's line and the call's hash (NOTE [call agreement])."""
    site = user_site()
    publish(call, site)
    return site, _call_hash(call, site)


# Calls that read a global tensor's value (their errors explain that this is a collective).
READING_CALLS = ("item()", "tolist()", "numpy()", "print()", "format()")


@dataclass(frozen=True)
class Gathered:
    shapes: list[tuple[int, ...]]  # per world rank (as passed)


def exchange(mine: RankMeta, what: str, compare_shapes: bool) -> Gathered:
    """All-gather ``mine``; raise the same ``ValueError`` on every rank on any disagreement.

    ``compare_shapes``: shapes must be equal across ranks (global->global);
    otherwise only the ndim must agree (local shards may differ).
    """
    if len(mine.shape) > MAX_DIMS:
        mine = RankMeta(
            mine.error or f"tensors with more than {MAX_DIMS} dims are not supported (got {len(mine.shape)})",
            mine.dtype, mine.shape[:MAX_DIMS], mine.placement, mine.sbp, mine.in_placement,
        )  # fmt: skip
    if get_world_size() == 1:
        if mine.error:
            raise ValueError(f"{what} failed on 1 of 1 ranks:\n  rank 0: {mine.error}")
        return Gathered([mine.shape])
    site, call_hash = _enter(what)
    encoded = mine.encoded()
    must_match = encoded[:5] + (encoded[_HEADER:] if compare_shapes else [])
    if not collectives.same_on_every_rank(stable_hash(repr(must_match)) ^ call_hash):
        _raise_everywhere(mine, what, compare_shapes, site)
    # Decoded as Python lists: per-element tensor indexing costs ~100 us per call.
    rows = collectives.all_gather_meta(encoded)
    shapes = [tuple(row[_HEADER : _HEADER + row[2]]) for row in rows]
    errors_flagged = any(row[0] for row in rows)
    columns = [1, 3, 4] + ([2] if not compare_shapes else [])
    disagree = any(row[c] != rows[0][c] for row in rows for c in columns)
    if compare_shapes:
        disagree = disagree or len(set(shapes)) > 1
    if errors_flagged or disagree:
        _raise_everywhere(mine, what, compare_shapes, site)
    return Gathered(shapes)


def agree(mine: RankMeta, what: str) -> None:
    """The fast form of ``exchange`` for calls whose whole vector must match on every rank.

    The vector's hash is cached on ``mine``; the check is one all_reduce of
    two int64 values, and only a mismatch pays for readable messages. ``what``
    names the call; with the user's line it must match too (NOTE [call agreement]).
    """
    if get_world_size() == 1:
        return
    site, call_hash = _enter(what)
    if not collectives.same_on_every_rank(mine.digest ^ call_hash):
        _raise_everywhere(mine, what, compare_shapes=True, site=site)


def _raise_everywhere(mine: RankMeta, what: str, compare_shapes: bool, site: str) -> None:
    entries: list[tuple[RankMeta, str, str]] = collectives.all_gather_object((mine, what, site))
    if len({(call, where) for _, call, where in entries}) > 1:
        raise CollectiveError(_different_calls(entries))
    metas = [meta for meta, _, _ in entries]
    errors = [(r, m.error) for r, m in enumerate(metas) if m.error]
    if errors:
        lines = "\n".join(f"  rank {r}: {e}" for r, e in errors)
        raise ValueError(f"{what} failed on {len(errors)} of {len(metas)} ranks:\n{lines}")
    fields = [
        ("placement", lambda m: m.placement),
        ("sbp", lambda m: m.sbp),
        ("dtype", lambda m: str(m.dtype)),
    ]
    if compare_shapes:
        fields.append(("shape", lambda m: str(list(m.shape))))
    else:
        fields.append(("ndim", lambda m: str(len(m.shape))))
    mismatches = []
    for name, get in fields:
        values = [get(m) for m in metas]
        if len(set(values)) > 1:
            mismatches.append(
                f"  {name}: " + ", ".join(f"rank {r} passed {v}" for r, v in enumerate(values))
            )
    raise ValueError(
        f"ranks disagree in {what}:\n"
        + "\n".join(mismatches)
        + "\nEvery rank runs the same program "
        "and must pass the same placement, SBP and dtype (and, for global tensors, shape). "
        "Check for rank-dependent branches before this call."
    )


def _reading_hint(call: str, sbps: list[str]) -> str:
    """How to read a value when only some ranks called ``call``: on every rank. ``to_local()``
    is offered only where it is the value (every axis broadcast): a partial tensor's piece is
    a part of a sum, a split tensor's a slice."""
    axes = {axis for sbp in sbps for axis in sbp.strip("()").split(", ")}
    partial = any(axis.startswith("P") for axis in axes)
    kind = "partial " if partial else ""
    hint = (
        f"reading a {kind}global tensor ({call}) is a collective: call it on every rank, also "
        "where only one rank prints; sbpflow.env.print0(...) formats its arguments on every "
        "rank and prints on rank 0."
    )
    if partial:
        return hint + " (t.to_local() is only this rank's part of the sum, not the value.)"
    if axes == {"B"}:
        return hint + " t.to_local() is this rank's copy of the whole value, with no collective."
    return hint


def _different_calls(entries: list[tuple[RankMeta, str, str]]) -> str:
    """The error when ranks entered different calls: who was where, and why it matters."""
    me = get_rank()
    _, call, site = entries[me]
    others = ", ".join(
        f"rank {r} was in {c} at {s}"
        for r, (_, c, s) in enumerate(entries)
        if (c, s) != (call, site)
    )
    reading = [(m, c) for m, c, _ in entries if c in READING_CALLS]
    if reading:
        hint = _reading_hint(reading[0][1], [m.sbp for m, _ in reading])
    else:
        hint = (
            "every rank must make the same sbpflow calls in the same order: look for "
            "rank-dependent branches (if rank == 0: ...) around these lines."
        )
    return f"sbpflow: {others} while rank {me} waited in {call} at {site} — {hint}"
