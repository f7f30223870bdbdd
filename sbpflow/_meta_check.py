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
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass

import torch

from .comm import collectives

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
    # Decoded as Python lists: per-element tensor indexing costs ~100 us per call.
    rows = collectives.all_gather_meta(mine.encode())
    shapes = [tuple(row[_HEADER : _HEADER + row[2]]) for row in rows]
    errors_flagged = any(row[0] for row in rows)
    columns = [1, 3, 4] + ([2] if not compare_shapes else [])
    disagree = any(row[c] != rows[0][c] for row in rows for c in columns)
    if compare_shapes:
        disagree = disagree or len(set(shapes)) > 1
    if errors_flagged or disagree:
        _raise_everywhere(mine, what, compare_shapes)
    return Gathered(shapes)


def agree(mine: RankMeta, what: str) -> None:
    """The fast form of ``exchange`` for calls whose whole vector must match on every rank.

    The vector's hash is cached on ``mine``; the check is one all_reduce of
    two int64 values, and only a mismatch pays for readable messages.
    """
    if not collectives.same_on_every_rank(mine.digest):
        _raise_everywhere(mine, what, compare_shapes=True)


def _raise_everywhere(mine: RankMeta, what: str, compare_shapes: bool) -> None:
    metas: list[RankMeta] = collectives.all_gather_object(mine)
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
