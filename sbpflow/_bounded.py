"""Caches with a size bound: memo tables keyed by shapes must not grow with every new shape.

# NOTE [bounded caches]
# The dispatcher's decisions, its fast-path entries, the interned metadata and
# the boxing meta checks are keyed by logical shapes. A training loop repeats a
# few hundred keys, but variable sequence lengths add new ones for as long as
# the job runs. Each such cache is a ``BoundedDict`` with a named bound: a hit
# is a plain dict look-up, and an insert past the bound first drops the oldest
# entry (a later call of that key recomputes it, a miss and nothing worse).
"""

from __future__ import annotations

from typing import Any, TypeVar

__all__ = ["BoundedDict", "bounded_caches"]

K = TypeVar("K")
V = TypeVar("V")

_caches: dict[str, BoundedDict[Any, Any]] = {}


class BoundedDict(dict[K, V]):
    """A dict holding at most ``bound`` entries; inserting a new key past it drops the oldest.

    Reads (``get``, ``[]``, ``in``) are a dict's own. Only ``d[key] = value``
    enforces the bound: ``setdefault`` and ``update`` must not be used.
    """

    __slots__ = ("bound", "name")

    def __init__(self, name: str, bound: int) -> None:
        super().__init__()
        if bound < 1:
            raise ValueError(f"a cache bound must be at least 1, got {bound} for {name!r}.")
        self.name, self.bound = name, bound
        _caches[name] = self

    def __setitem__(self, key: K, value: V) -> None:
        # Insertion order: the oldest entries come first. Threads dispatching at once may
        # race here; the loser leaves the dict a few entries over the bound, and the next
        # insert brings it back.
        while len(self) >= self.bound and key not in self:
            try:
                self.pop(next(iter(self)), None)
            except (StopIteration, RuntimeError):  # another thread changed the dict meanwhile
                break
        super().__setitem__(key, value)

    def __repr__(self) -> str:
        return f"BoundedDict({self.name!r}, {len(self)}/{self.bound} entries)"


def bounded_caches() -> dict[str, BoundedDict[Any, Any]]:
    """Every ``BoundedDict`` made so far, by name (for tests and for inspecting memory)."""
    return dict(_caches)
