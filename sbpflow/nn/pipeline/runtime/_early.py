"""Which receives a pipelined step posts one action early.

# NOTE [next action's receives]
# A rank holding one stage runs its compute actions one after another, and the
# input of most of them comes from another rank: the activation a forward
# receives, the gradient a backward receives. Received only when the action
# starts, that message has to wait for the sender's gloo thread to write it, and
# on a busy host that delay (a millisecond or more) lands between two actions
# on every micro-batch. So a step posts the next action's receives while the
# current one computes (NOTE [receives posted early] in _transfers.py):
# once action i has made as many receives as it made in the previous step,
# action i + 1's receives of that step are posted. The previous step is the
# latest one with the same schedule, micro-batch shapes, grad mode, autocast,
# and the stages' parameter and buffer layouts, ``requires_grad`` and training
# flags: a ``build`` that moves the same tensors for inputs of the same shapes
# (what a pipeline's stand-ins already rely on, NOTE [stages held elsewhere])
# makes the same receives in the same order. Whatever a step does, each message
# still lands in the receive the program makes for it (receives are taken in
# posting order); a receive whose buffer has another shape than the one posted
# early for its message raises, naming ``Graph.config.enable_early_receives``
# for a ``build`` whose transfers depend on its data. Only a rank holding one
# stage posts early, and only gloo receives: on a rank with several stages the
# worker threads' order decides which receive comes next.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch.utils._pytree import tree_flatten

from ....comm._world import get_rank
from ._held_elsewhere import call_key
from ._held_here import tensor_state
from ._microbatch import MicroBatchArgs
from ._stages import Stage
from ._transfers import Receive, StepTransfers

__all__ = ["EarlyReceives", "StepReceives"]

# Steps of distinct input shapes whose receives a graph keeps (the oldest is dropped).
KEPT_STEPS = 8


class EarlyReceives:
    """Per kind of step, the receives each compute action made the last time (kept by the graph)."""

    def __init__(self) -> None:
        self.enabled = True
        self._made: dict[Any, list[list[Receive]]] = {}

    def start(
        self,
        sends: StepTransfers,
        schedule: Any,
        microbatches: Sequence[MicroBatchArgs],
        stages: Sequence[Stage],
    ) -> StepReceives:
        """Track (and post early) the receives of a step run one action at a time."""
        key = _step_key(schedule, microbatches, stages) if self.enabled else None
        return StepReceives(self, key, sends, self._made.get(key) if key is not None else None)

    def keep(self, key: Any, made: list[list[Receive]]) -> None:
        """Keep the receives each action of a step of kind ``key`` made."""
        if all(r.route[0] == "cpu" for action in made for r in action):
            self._made.pop(key, None)
            self._made[key] = made
            while len(self._made) > KEPT_STEPS:
                del self._made[next(iter(self._made))]
        else:  # NOTE [receives posted early]: gloo only
            self._made.pop(key, None)


class StepReceives:
    """One step's receives per action; posts action i + 1's once action i has made its own.

    A step that raises never reaches ``finish``: its receives are not kept, and those it
    posted early wait for the next receives from their peers (NOTE [receives posted early]).
    """

    def __init__(
        self,
        owner: EarlyReceives,
        key: Any,
        sends: StepTransfers,
        previous: list[list[Receive]] | None,
    ) -> None:
        self._owner, self._key, self._sends, self._previous = owner, key, sends, previous
        self._made: list[list[Receive]] = []
        self._current: list[Receive] = []
        self._then: tuple[int, list[Receive]] | None = None  # after n receives, post these
        sends.on_receive = self._received

    def before(self, index: int) -> None:
        """Action ``index`` starts (NOTE [next action's receives])."""
        self._current = []
        self._made.append(self._current)
        self._then = None
        previous = self._previous
        if previous is None or index + 1 >= len(previous) or not previous[index + 1]:
            return
        if previous[index]:
            self._then = (len(previous[index]), previous[index + 1])
        else:  # this action receives nothing: the next one's may come now
            self._sends.post_early(previous[index + 1])

    def _received(self, receive: Receive) -> None:
        self._current.append(receive)
        then = self._then
        if then is not None and len(self._current) == then[0]:
            self._then = None
            self._sends.post_early(then[1])

    def finish(self) -> None:
        """The step ran to its end: keep its receives for the next step of its kind."""
        self._sends.on_receive = None
        if self._key is not None:
            self._owner.keep(self._key, self._made)


def _step_key(
    schedule: Any, microbatches: Sequence[MicroBatchArgs], stages: Sequence[Stage]
) -> Any:
    """What a step's transfers may depend on, hashable; ``None`` if its inputs are not all
    tensors and constants (the key of a stage's call, over the whole step)."""
    modules = [m for stage in stages for m in stage.module.modules()]
    tensors = [
        t for m in modules for t in (*m._parameters.values(), *m._buffers.values()) if t is not None
    ]
    state = (
        id(schedule),
        tuple(m.training for m in modules),
        tuple(tensor_state(t) for t in tensors),
    )
    flat, spec = tree_flatten(list(microbatches))
    return call_key(state, flat, spec, get_rank(), held=True)
