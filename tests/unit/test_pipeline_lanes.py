"""Which lanes a pipelined step makes before its first action (``lane_pairs``, NOTE [lanes] in
sbpflow/nn/pipeline/runtime/_transfers.py). Pure: placements only, no process group.

The reference is each schedule's own list of messages (``build_schedule``, independent of the
runtime): every activation a rank sends and every gradient it sends back must travel on a pair
the step made. Data that skips stages (a skip connection, a weight tied to a later stage) and
an input on a placement no stage is on need pairs no schedule message names.
"""

from __future__ import annotations

import pytest

import sbpflow
from sbpflow.nn.pipeline import SCHEDULE_NAMES, ActionKind, build_schedule
from sbpflow.nn.pipeline.runtime import Stage
from sbpflow.nn.pipeline.runtime._transfers import lane_pairs

_LAYOUTS = {  # stage s on rank layout[s], as the schedule family lays them on 4 ranks
    "one": [0, 1, 2, 3],
    "round robin": [0, 1, 2, 3, 0, 1, 2, 3],
    "v": [0, 1, 2, 3, 3, 2, 1, 0],
}
_LAYOUT_OF = {
    "gpipe": "one",
    "1f1b": "one",
    "zero_bubble": "one",
    "interleaved_1f1b": "round robin",
    "looped_bfs": "round robin",
    "interleaved_zero_bubble": "round robin",
    "zbv": "v",
    "dualpipev": "v",
}


def _on(*ranks: int) -> sbpflow.Placement:
    return sbpflow.placement("cpu", list(ranks))


def _stages(layout: list[int]) -> list[Stage]:
    return [Stage(f"s{s}", None, s, _on(r)) for s, r in enumerate(layout)]  # type: ignore[arg-type]


@pytest.mark.parametrize("name", SCHEDULE_NAMES)
def test_every_message_of_each_schedule_travels_on_a_pair_made_before_the_step(name: str) -> None:
    layout = _LAYOUTS[_LAYOUT_OF[name]]
    schedule = build_schedule(name, len(layout), layout, 8)
    made = set(lane_pairs(_stages(layout)))
    sent = 0
    for rank, actions in schedule.actions.items():
        for a in actions:
            if a.kind is ActionKind.SEND_ACTIVATION:  # forward: this rank to the peer
                assert (_on(rank), _on(a.peer)) in made, (name, str(a))
                sent += 1
            elif a.kind is ActionKind.SEND_GRAD:  # back along the pair the tensor came on
                assert (_on(a.peer), _on(rank)) in made, (name, str(a))
                sent += 1
    assert sent > 0, name


def test_data_skipping_stages_and_inputs_from_elsewhere_have_their_pairs() -> None:
    stages = _stages([0, 1, 2, 3])
    everyone = _on(0, 1, 2, 3)
    made = lane_pairs(stages, [_on(0), everyone])
    assert (_on(0), _on(2)) in made  # stage 0's output skipping stage 1
    assert (_on(0), _on(3)) in made  # a weight of stage 0 tied to the last stage
    assert [p for p in made if p[0] == everyone] == [(everyone, _on(r)) for r in range(4)]
    assert all(src != dst for src, dst in made)
    assert len(made) == len(set(made)) == 6 + 4
