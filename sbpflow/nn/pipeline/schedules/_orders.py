"""The compute order of each schedule: per pipeline rank, which F / B / I / W runs next.

Pure list building. Transfers are added afterwards (``_build._with_transfers``)
and everything is checked by ``_validate``. ``p`` is the number of pipeline
ranks, ``m`` the number of micro-batches, ``r`` a rank's position (0..p-1) and,
for interleaved, ``v`` the stages per rank: stage ``c * p + r`` is rank ``r``'s
chunk ``c``.

NOTE [the four orders]
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
