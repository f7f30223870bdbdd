"""The schedules with several stages per rank, as data: looped BFS, interleaved zero bubble
(also ``zero_bubble`` dealt round-robin), ZBV and DualPipeV. No process group.

The single-process reference is arithmetic done here: each (stage, micro-batch) counted
from the action lists, the bubble fractions from their closed forms with per-stage times
1/v of a rank's (F = I = W for the zero-bubble family: (p-1)/(v*m+p-1) for looped BFS,
(p-1)/(3*v*m+p-1) for interleaved zero bubble, ZBV and DualPipeV), and the activation
peaks from each schedule's memory bound. Hand-broken copies of each schedule must be
rejected by ``validate``.
"""

from __future__ import annotations

import dataclasses
from collections import Counter

import pytest

from sbpflow.nn.pipeline import Action, ActionKind, Schedule, build_schedule, validate

F, B, BI, W = (
    ActionKind.FORWARD,
    ActionKind.BACKWARD,
    ActionKind.BACKWARD_INPUT,
    ActionKind.BACKWARD_WEIGHT,
)
ROUND_ROBIN = ("looped_bfs", "interleaved_zero_bubble", "zero_bubble")
V_SHAPED = ("zbv", "dualpipev")
NEW = (*ROUND_ROBIN, *V_SHAPED)


def _ranks(name: str, p: int, v: int = 2) -> list[int]:
    return list(range(p)) + list(range(p))[::-1] if name in V_SHAPED else list(range(p)) * v


def _build(name: str, p: int, m: int, v: int = 2) -> Schedule:
    ranks = _ranks(name, p, v)
    return build_schedule(name, len(ranks), ranks, m)


CASES = [
    (name, p, m, v)
    for p in (1, 2, 3, 4)
    for m in (2 * p, 2 * p + 2, 4 * p)
    for name in NEW
    for v in ((2, 3) if name in ROUND_ROBIN else (2,))
    if not (name in ("interleaved_zero_bubble", "zero_bubble") and m % max(1, m // p))
]


@pytest.mark.parametrize(("name", "p", "m", "v"), CASES)
def test_each_stage_and_microbatch_runs_forward_and_backward_exactly_once(
    name: str, p: int, m: int, v: int
) -> None:
    """Counted from the lists: F once, and B once or I and W once, each on its stage's rank;
    one activation and one gradient cross each boundary between ranks per micro-batch."""
    schedule = _build(name, p, m, v)
    ranks = _ranks(name, p, v)
    compute: Counter[tuple[int, int, str]] = Counter()
    transfers: Counter[tuple[ActionKind, int, int]] = Counter()
    for rank, actions in schedule.actions.items():
        for a in actions:
            assert ranks[a.stage] == rank, (a, rank)
            if a.is_compute:
                compute[(a.stage, a.microbatch, a.kind.value)] += 1
            else:
                transfers[(a.kind, a.stage, a.microbatch)] += 1
    for s in range(len(ranks)):
        for k in range(m):
            done = {kind for (st, mb, kind), n in compute.items() if (st, mb) == (s, k) and n == 1}
            assert done in ({"F", "B"}, {"F", "I", "W"}), (s, k, done)
    assert sum(compute.values()) == sum(
        2 + (compute[(s, k, "I")] > 0) for s in range(len(ranks)) for k in range(m)
    )
    for s in range(len(ranks) - 1):
        crossing = ranks[s] != ranks[s + 1]
        for k in range(m):
            assert transfers[(ActionKind.SEND_ACTIVATION, s, k)] == crossing
            assert transfers[(ActionKind.RECV_ACTIVATION, s + 1, k)] == crossing
            assert transfers[(ActionKind.SEND_GRAD, s + 1, k)] == crossing
            assert transfers[(ActionKind.RECV_GRAD, s, k)] == crossing


def _bubble(name: str, p: int, m: int, v: int) -> float:
    """The closed form, per-stage times 1/v of a rank's (F = I = W = B/2)."""
    if name == "looped_bfs":
        return (p - 1) / (v * m + p - 1)
    return (p - 1) / (3 * v * m + p - 1)


@pytest.mark.parametrize(("name", "p", "m", "v"), [c for c in CASES if c[2] >= 2 * c[1]])
def test_bubble_fractions_match_the_closed_forms(name: str, p: int, m: int, v: int) -> None:
    schedule = _build(name, p, m, v)
    sim = schedule.simulate(forward_time=1.0 / v, backward_time=2.0 / v)
    assert sim.bubble_fraction == pytest.approx(_bubble(name, p, m, v), abs=1e-12)


def test_zero_bubble_dealt_round_robin_runs_the_interleaved_zero_bubble_order() -> None:
    for p, m in [(2, 4), (3, 6), (4, 8)]:
        plain = _build("zero_bubble", p, m)
        interleaved = _build("interleaved_zero_bubble", p, m)
        assert plain.actions == interleaved.actions
        assert plain.name == "zero_bubble"
    # one stage per rank stays ZB-H1
    assert _build("zero_bubble", 4, 8, v=1).actions != _build("interleaved_zero_bubble", 4, 8, 1)


@pytest.mark.parametrize(("p", "m"), [(2, 4), (3, 6), (4, 8), (4, 16)])
def test_activation_peaks_are_the_memory_bounds(p: int, m: int) -> None:
    """Live from F until B or W: looped BFS holds every micro-batch (m per stage); interleaved
    zero bubble holds v*p stage-micro-batches per rank (p of the rank's layers, as 1F1B);
    ZBV holds 2p - s on stage s and 2p per rank (p micro-batches of the rank's layers);
    DualPipeV the same per stage and one more per rank."""
    n = 2 * p
    bfs = _build("looped_bfs", p, m)
    assert bfs.peak_live_microbatches == dict.fromkeys(range(n), m)
    izb = _build("interleaved_zero_bubble", p, m)
    assert max(izb.peak_live_per_rank.values()) == 2 * p
    for name, per_rank in [("zbv", 2 * p), ("dualpipev", 2 * p + 1)]:
        schedule = _build(name, p, m)
        assert schedule.peak_live_microbatches == {s: 2 * p - s for s in range(n)}, name
        assert set(schedule.peak_live_per_rank.values()) == {per_rank}, name


def _edit(schedule: Schedule, rank: int, actions: list[Action]) -> Schedule:
    return dataclasses.replace(schedule, actions={**schedule.actions, rank: tuple(actions)})


@pytest.mark.parametrize("name", NEW)
def test_hand_broken_copies_are_rejected(name: str) -> None:
    """Each schedule, broken by hand in the ways a wrong order generator would: a W before
    its I (or a B before its forward), a lost action, one twice, a missing receive, two
    messages of one lane received in the other order, and a forward before its input."""
    schedule = _build(name, 2, 4)
    validate(schedule)
    rank = 1
    todo = list(schedule.actions[rank])
    compute = [a for a in todo if a.is_compute]
    backward = next(a for a in compute if a.kind in (B, BI))
    forward = Action(F, backward.stage, backward.microbatch)
    swapped = list(todo)
    i, j = swapped.index(forward), swapped.index(backward)
    swapped[i], swapped[j] = swapped[j], swapped[i]
    with pytest.raises(ValueError, match=r"runs before its forward|reads its input"):
        validate(_edit(schedule, rank, swapped))
    with pytest.raises(ValueError, match=r"never runs its|without its other half"):
        validate(_edit(schedule, rank, [a for a in todo if a != compute[-1]]))
    with pytest.raises(ValueError, match=r"appears 2 times on rank 1"):
        validate(_edit(schedule, rank, [*todo, compute[0]]))
    recv = next(a for a in todo if a.kind is ActionKind.RECV_ACTIVATION)
    with pytest.raises(ValueError, match=r"has no matching send|is never received"):
        validate(_edit(schedule, rank, [a for a in todo if a != recv]))
    recvs = [k for k, a in enumerate(todo) if a.kind is ActionKind.RECV_ACTIVATION]
    late = list(todo)
    late[recvs[0]], late[recvs[1]] = late[recvs[1]], late[recvs[0]]
    with pytest.raises(ValueError, match=r"another order|reads its input"):
        validate(_edit(schedule, rank, late))
    splits = [a for a in compute if a.kind is W]
    if splits:
        w = splits[0]
        moved = [a for a in todo if a != w]
        moved.insert(moved.index(Action(BI, w.stage, w.microbatch)), w)
        with pytest.raises(ValueError, match="runs before its input-grad half I"):
            validate(_edit(schedule, rank, moved))


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ("zbv", 4, [0, 1, 0, 1], 4),
            r"zbv puts two stages on each of its 2 ranks as a V.*\[0, 1, 1, 0\]",
        ),
        (
            ("dualpipev", 4, [0, 1, 1, 0], 3),
            r"dualpipev needs at least as many micro-batches as stages \(4\)",
        ),
        (
            ("looped_bfs", 4, [0, 0, 1, 1], 4),
            r"looped_bfs deals stages round-robin .* \[0, 1, 0, 1\]",
        ),
        (
            ("interleaved_zero_bubble", 4, [0, 1, 0, 1], 5),
            r"rounds of about 2 .* multiple of num_microbatches // 2 = 2, got 5",
        ),
        (("zbv", 3, [0, 1, 0], 4), r"should be \[0, 1, 1, 0\]"),
    ],
)
def test_bad_layouts_raise_naming_the_expected_one(args: tuple, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        build_schedule(*args)


@pytest.mark.parametrize("name", NEW)
def test_str_and_html_show_each_rank(name: str) -> None:
    schedule = _build(name, 2, 4)
    lines = str(schedule).splitlines()
    assert lines[0].startswith(f"{name}: 4 stages")
    for rank, line in zip((0, 1), lines[2:4], strict=True):
        cells = [c for c in line.partition(" | ")[2].split() if c != "."]
        assert cells == [str(a) for a in schedule.actions[rank] if a.is_compute]
    assert schedule._repr_html_().count('class="lane"') == 2
