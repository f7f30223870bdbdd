"""The compute order of each schedule: per pipeline rank, which F / B / I / W runs next.

Pure list building. Transfers are added afterwards (``_build._with_transfers``)
and everything is checked by ``_validate``. ``p`` is the number of pipeline
ranks, ``m`` the number of micro-batches, ``r`` a rank's position (0..p-1) and,
for interleaved, ``v`` the stages per rank: stage ``c * p + r`` is rank ``r``'s
chunk ``c``.

NOTE [the orders]
  gpipe             F0..F(m-1), then B0..B(m-1)                 every stage holds m
  1f1b              (p-r-1) warm-up F, then F/B pairs, then B   stage r holds p-r
  interleaved_1f1b  Megatron: micro-batches in groups of p, each group through
                    chunk 0..v-1 forwards (v-1..0 backwards); warm-up
                    2(p-r-1) + (v-1)p forwards, then F/B pairs
  zero_bubble       ZB-H1: the 1F1B order of F and I (the input-grad half of B,
                    whose grad goes upstream at once); rank r defers each W (the
                    weight-grad half) by r micro-batches, so the Ws pile up where
                    1F1B's cool-down bubble was. With F = I = W the idle time is
                    (p-1) per rank against 1F1B's 3(p-1). F and I interleave as in
                    1F1B (stage r holds p-r activations), and counting held until
                    W, stage r holds at most (p-r) + r = p: 1F1B's peak.
  looped_bfs        Lamy-Poirier's breadth-first pipeline: each chunk runs the
                    forwards of every micro-batch before the next chunk starts,
                    then the chunks' backwards in reverse (micro-batches last to
                    first); a rank holds all v*m stage-micro-batches at the peak.
  interleaved_zero_bubble
                    ZB1P (Qi et al.): interleaved 1F1B's order of F and I with
                    rounds of micro-batches through the chunks, a warm-up of
                    (v-1)*round + (p-r-1) forwards, each W deferred by r I's
  zbv               ZB-V (Qi et al., section 6): 2 chunks per rank laid out as a
                    V (rank r holds stages r and 2p-1-r), so the last stage and
                    the first are on rank 0; F, I, W of the two chunks alternate
                    so that with F = I = W the pipeline has no bubble left but
                    its fill and drain
  dualpipev         DeepSeek's DualPipe cut to a V (2 chunks per rank as zbv):
                    the steady state pairs a forward of one chunk with a full
                    backward of the other (F&B), the drain splits backwards
                    into I and W
The last three follow torch.distributed.pipelining's orders of the same names.
"""

from __future__ import annotations

from .actions import Action, backward, backward_input, backward_weight, forward


def gpipe(p: int, m: int) -> list[list[Action]]:
    return [
        [forward(r, k) for k in range(m)] + [backward(r, k) for k in range(m)] for r in range(p)
    ]


def one_f_one_b(p: int, m: int) -> list[list[Action]]:
    orders = []
    for r in range(p):
        warmup = min(p - r - 1, m)
        order = [forward(r, k) for k in range(warmup)]
        for k in range(m - warmup):
            order += [forward(r, warmup + k), backward(r, k)]
        order += [backward(r, k) for k in range(m - warmup, m)]
        orders.append(order)
    return orders


def interleaved_1f1b(p: int, v: int, m: int) -> list[list[Action]]:
    """Megatron's interleaved 1F1B; needs ``m % p == 0``."""
    total = m * v  # (chunk, micro-batch) pairs per rank

    def chunk_and_mb(k: int, *, backward_pass: bool) -> tuple[int, int]:
        group, within = divmod(k, p * v)
        chunk = within // p
        if backward_pass:
            chunk = v - 1 - chunk
        return chunk, group * p + within % p

    orders = []
    for r in range(p):

        def fwd(k: int, r: int = r) -> Action:
            chunk, mb = chunk_and_mb(k, backward_pass=False)
            return forward(chunk * p + r, mb)

        def bwd(k: int, r: int = r) -> Action:
            chunk, mb = chunk_and_mb(k, backward_pass=True)
            return backward(chunk * p + r, mb)

        warmup = min(2 * (p - r - 1) + (v - 1) * p, total)
        order = [fwd(k) for k in range(warmup)]
        for k in range(total - warmup):
            order += [fwd(warmup + k), bwd(k)]
        order += [bwd(k) for k in range(total - warmup, total)]
        orders.append(order)
    return orders


def zero_bubble(p: int, m: int) -> list[list[Action]]:
    """ZB-H1: 1F1B with B split into I (sent upstream at once) and a deferred W."""
    orders = []
    for r in range(p):
        warmup = min(p - r - 1, m)
        lag = min(r, m)  # W of micro-batch k runs after I of micro-batch k + lag
        order = [forward(r, k) for k in range(warmup)]
        weights = 0
        for k in range(m - warmup):
            order += [forward(r, warmup + k), backward_input(r, k)]
            if k >= lag:
                order.append(backward_weight(r, weights))
                weights += 1
        for k in range(m - warmup, m):
            order.append(backward_input(r, k))
            order.append(backward_weight(r, weights))
            weights += 1
        order += [backward_weight(r, k) for k in range(weights, m)]
        orders.append(order)
    return orders


def looped_bfs(p: int, v: int, m: int) -> list[list[Action]]:
    """Breadth-first: all forwards of chunk 0, then chunk 1, ...; backwards in reverse."""
    orders = []
    for r in range(p):
        chunks = [c * p + r for c in range(v)]
        order = [forward(s, k) for s in chunks for k in range(m)]
        order += [backward(s, k) for s in reversed(chunks) for k in reversed(range(m))]
        orders.append(order)
    return orders


def interleaved_zero_bubble(p: int, v: int, m: int) -> list[list[Action]]:
    """ZB1P: interleaved 1F1B with B split into I and a W deferred by ``r`` I's."""
    rounds = max(1, m // p)
    per_round = m // rounds  # micro-batches through each chunk before the next chunk
    total = v * m

    def pick(i: int, *, reverse: bool) -> tuple[int, int]:
        """The i-th (chunk, micro-batch) of a rank's forwards (or backwards)."""
        group, within = divmod(i, per_round * v)
        chunk = within // per_round
        return (v - 1 - chunk if reverse else chunk), group * per_round + within % per_round

    orders = []
    for r in range(p):
        warmup = min((v - 1) * per_round + (p - r - 1), total)
        order: list[Action] = []
        for i in range(warmup):
            chunk, k = pick(i, reverse=False)
            order.append(forward(chunk * p + r, k))
        inputs: list[Action] = []
        for i in range(total):
            if warmup + i < total:
                chunk, k = pick(warmup + i, reverse=False)
                order.append(forward(chunk * p + r, k))
            chunk, k = pick(i, reverse=True)
            inputs.append(backward_input(chunk * p + r, k))
            order.append(inputs[-1])
            if i >= r:
                done = inputs[i - r]
                order.append(backward_weight(done.stage, done.microbatch))
        order += [backward_weight(a.stage, a.microbatch) for a in inputs[max(0, total - r) :]]
        orders.append(order)
    return orders


def zbv(p: int, m: int) -> list[list[Action]]:
    """ZB-V: rank r holds stages r (chunk 0) and 2p-1-r (chunk 1)."""
    return [_zbv_rank(p, m, r) for r in range(p)]


def dualpipev(p: int, m: int) -> list[list[Action]]:
    """DualPipeV: rank r holds stages r and 2p-1-r; needs ``m >= 2p``."""
    return [_dualpipev_rank(p, m, r) for r in range(p)]


class _Counts:
    """A rank's order being written, with the next micro-batch of each (stage, kind)."""

    def __init__(self) -> None:
        self.order: list[Action] = []
        self.next: dict[tuple[int, str], int] = {}

    def add(self, kind: str, stage: int, *, count_as: str | None = None) -> Action:
        """Append the next ``kind`` action of ``stage`` (numbered as ``count_as``'s)."""
        key = (stage, count_as or kind)
        k = self.next.get(key, 0)
        self.next[key] = k + 1
        make = {"F": forward, "B": backward, "I": backward_input, "W": backward_weight}[kind]
        self.order.append(make(stage, k))
        return self.order[-1]

    def count(self, kind: str, stage: int) -> int:
        return self.next.get((stage, kind), 0)


def _zbv_rank(p: int, m: int, r: int) -> list[Action]:
    first, second = r, 2 * p - 1 - r
    padded = max(2 * p - 1, m)  # the order for enough micro-batches to fill the V
    c = _Counts()

    def forward_input_weight(stage: int) -> None:
        c.add("F", stage)
        c.add("I", stage)
        c.add("W", stage)

    for _ in range(2 * (p - r) - 1):
        c.add("F", first)
    for _ in range(r):
        c.add("F", second)
        c.add("F", first)
    for _ in range(p - r):
        forward_input_weight(second)
    while c.count("F", second) < c.count("F", first) or c.count("F", first) < padded:
        if c.count("F", first) < padded:
            c.add("F", first)
        c.add("I", first)
        c.add("W", first)
        forward_input_weight(second)
    for _ in range(r):
        c.add("I", first)
        c.add("I", second)
    for _ in range(p - r):
        c.add("I", first)
        c.add("W", first)
    while c.count("W", second) < c.count("I", second):
        c.add("W", second)
    while c.count("W", first) < c.count("I", first):
        c.add("W", first)
    return [a for a in c.order if a.microbatch < m]


def _dualpipev_rank(p: int, m: int, r: int) -> list[Action]:
    first, second = r, 2 * p - 1 - r
    c = _Counts()
    deferred: list[Action] = []  # W's of split backwards, oldest first

    def back(stage: int, split: bool) -> None:
        if split:
            done = c.add("I", stage)
            deferred.append(backward_weight(stage, done.microbatch))
        else:
            c.add("B", stage, count_as="I")

    def weight() -> None:
        if deferred:
            c.order.append(deferred.pop(0))

    for _ in range(2 * (p - r - 1)):
        c.add("F", first)
    for _ in range(r + 1):
        c.add("F", first)
        c.add("F", second)
    for _ in range(p - r - 1):
        back(second, split=True)
        weight()
        c.add("F", second)
    for _ in range(m - 2 * p + r + 1):  # the steady state: F&B pairs
        c.add("F", first)
        back(second, split=False)
        c.add("F", second)
        back(first, split=False)
    for _ in range(p - r - 1):
        back(second, split=False)
        c.add("F", second)
        back(first, split=False)
    split = False
    for i in range(r + 1):  # the second half of the drain splits its backwards
        if i == (r + 1) // 2 and r % 2 == 1:
            split = True
        back(second, split)
        if i == (r + 1) // 2 and r % 2 == 0:
            split = True
        back(first, split)
    for _ in range(p - r - 1):
        weight()
        back(first, split)
    for _ in range(r + 1):
        weight()
    return c.order
