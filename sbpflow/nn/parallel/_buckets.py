"""Which gradients share a bucket: pure code, no process group.

# NOTE [bucket order]
# Every rank must launch the same buckets in the same order, or their
# collectives pair up wrongly and hang. Buckets are therefore fixed before the
# first backward, from the parameters' registration order alone, reversed as in
# torch DDP (the last layer's gradients are computed first). Gradients that
# reduce over different groups or with different dtypes cannot share a flat
# buffer, so each kind (``key``) fills its own bucket; a bucket closes once it
# holds ``cap_bytes`` or more. The first bucket of each kind closes at
# ``first_cap_bytes`` (torch DDP uses 1 MiB): the first gradients of backward
# are then on the wire early instead of waiting for a full bucket. Buckets are
# launched in the order of their first gradient in that list.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

__all__ = ["assign_buckets"]


def assign_buckets(
    entries: Sequence[tuple[Hashable, int]], cap_bytes: int, first_cap_bytes: int | None = None
) -> list[list[int]]:
    """Group ``entries`` (``(key, num_bytes)``, in launch order) into buckets of indices.

    Entries of one key fill a bucket in the order given until it holds ``cap_bytes`` or
    more (``first_cap_bytes`` for the key's first bucket, default ``cap_bytes``); the
    buckets come back ordered by their first entry (NOTE [bucket order]).
    """
    first_cap_bytes = cap_bytes if first_cap_bytes is None else first_cap_bytes
    if cap_bytes <= 0 or first_cap_bytes <= 0:
        raise ValueError(
            f"cap_bytes and first_cap_bytes must be positive, got {cap_bytes!r} and "
            f"{first_cap_bytes!r}."
        )
    open_buckets: dict[Hashable, tuple[list[int], int]] = {}
    keys_with_a_bucket: set[Hashable] = set()
    closed: list[list[int]] = []
    for index, (key, num_bytes) in enumerate(entries):
        members, size = open_buckets.get(key, ([], 0))
        members.append(index)
        size += num_bytes
        if size >= (cap_bytes if key in keys_with_a_bucket else first_cap_bytes):
            closed.append(members)
            keys_with_a_bucket.add(key)
            open_buckets.pop(key, None)
        else:
            open_buckets[key] = (members, size)
    closed.extend(members for members, _ in open_buckets.values())
    return sorted(closed, key=lambda members: members[0])
