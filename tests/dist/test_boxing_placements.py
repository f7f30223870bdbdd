"""Boxing between placements: disjoint, overlapping, growing and shrinking, every SBP pair.

Compared with a single-process reference: after ``x.to_global(dst_placement,
dst_sbp)`` each destination rank holds ``torch.tensor_split`` of the logical
tensor the test builds itself (P outputs must sum to it over the destination
ranks), and ranks outside the destination hold empty locals.
"""

from __future__ import annotations

import itertools
from typing import Any

from ._reference import SBPS, SHAPES
from .test_boxing_1d import Case, check_values, run_cases

PAIRS = [
    ((0, 1), (2, 3)),  # disjoint
    ((0, 1, 2), (1, 2, 3)),  # overlapping
    ((0,), (0, 1, 2, 3)),  # one rank to all
    ((0, 1, 2, 3), (3,)),  # all to one
]


def placement_cases() -> list[Case]:
    cases = []
    for pair_index, (src_ranks, dst_ranks) in enumerate(PAIRS):
        for shape_index, shape in enumerate(SHAPES):
            for sbp_index, (src, dst) in enumerate(itertools.product(SBPS, SBPS)):
                seed = 10_000 + 1000 * pair_index + 100 * shape_index + sbp_index
                cases.append((src_ranks, dst_ranks, shape, src, dst, seed))
    return cases


def test_every_sbp_pair_across_placements(pool: Any) -> None:
    cases = placement_cases()
    per_rank = pool(4).run(run_cases, cases)
    problems = check_values(cases, per_rank)
    assert not problems, f"{len(problems)} of {len(cases)} cases wrong:\n" + "\n".join(
        problems[:40]
    )
