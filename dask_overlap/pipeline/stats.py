"""Counters of one runtime: what moved, what waited, what is held now."""

from __future__ import annotations

import dataclasses
import threading
from typing import Any

__all__ = ["Counters", "Entry", "Retired"]


class Retired(RuntimeError):
    """A partition tried to enter a runtime retired to be built again or closing (see
    :meth:`Counters.retire` and :meth:`Counters.refuse`): the task asks for one again."""


class Entry:
    """A running partition, in ``Counters``: the most partitions that ran at once since it
    entered (itself included). Compared by identity."""

    __slots__ = ("peak",)

    def __init__(self, peak: int) -> None:
        self.peak = peak


@dataclasses.dataclass
class Counters:
    """Cumulative and current counts, updated under one lock by concurrent partitions."""

    partitions: int = 0
    partitions_failed: int = 0
    partitions_active: int = 0
    sub_chunks: int = 0
    # Sub-chunks whose stage spans were estimated rather than timed on the device (the
    # lean path's sampled timing, sampling.py)
    sub_chunks_estimated: int = 0
    bytes_staged: int = 0
    bytes_h2d: int = 0
    bytes_d2h: int = 0
    bytes_unstaged: int = 0
    in_flight: int = 0
    max_in_flight: int = 0
    max_window: int = 0
    pinned_fallbacks: int = 0
    ring_full: int = 0  # admissions the pinned ring refused for want of room (then waited)
    device_bytes_in_flight: int = 0
    window_capacity: int = 0  # sub-chunks the windows of the running partitions admit
    backpressure_seconds: float = 0.0
    busy_seconds: dict[str, float] = dataclasses.field(default_factory=dict)
    # CuPy arrays sent and received over TCP through this runtime's pinned pool, and those
    # that found no room in it and took distributed's own pageable path
    # (dask_overlap.cluster.serialize)
    serialized_pinned: int = 0
    bytes_serialized_pinned: int = 0
    serialize_fallbacks: int = 0
    deserialized_pinned: int = 0
    bytes_deserialized_pinned: int = 0
    deserialize_fallbacks: int = 0
    _lock: threading.Lock = dataclasses.field(
        default_factory=threading.Lock, repr=False, compare=False
    )
    # The running partitions' entries (see ``enter``), and the peak of the one that left last
    _live: list[Entry] = dataclasses.field(default_factory=list, repr=False, compare=False)
    _last_peak: int = 0
    _retired: bool = dataclasses.field(default=False, repr=False, compare=False)

    def _add(self, amounts: dict[str, float]) -> None:
        """Add ``amounts``; the caller holds the lock."""
        fields = self.__dict__  # (per partition, twice: plain dict access, not setattr)
        for name, amount in amounts.items():
            if amount:
                fields[name] += amount
        if self.in_flight > self.max_in_flight:
            self.max_in_flight = self.in_flight

    def add(self, **amounts: float) -> None:
        with self._lock:
            self._add(amounts)

    def enter(self) -> Entry:
        """A partition task starts: counted in ``partitions_active`` until it leaves.
        Its entry keeps the most partitions that ran at once while it ran (``sharing``)."""
        with self._lock:
            if self._retired:
                raise Retired("this runtime takes no more partitions (retired or closing)")
            self.partitions_active += 1
            n = self.partitions_active
            entry = Entry(n)
            live = self._live
            live.append(entry)
            for e in live:
                if e.peak < n:
                    e.peak = n
        return entry

    def retire(self) -> bool:
        """Whether no partition runs now; if none does, none may enter from now on
        (:meth:`enter` raises :class:`Retired`). Checked and marked under the lock that
        entering takes: a task that got the runtime just before cannot start on it once
        it is closed.

        >>> c = Counters()
        >>> entry = c.enter()
        >>> c.retire()
        False
        >>> c.leave(entry)
        >>> c.retire()
        True
        """
        with self._lock:
            if self.partitions_active:
                return False
            self._retired = True
            return True

    def refuse(self) -> None:
        """From now on no partition may enter (:meth:`enter` raises :class:`Retired`):
        the runtime is closing, and a task that looked it up just before asks again."""
        with self._lock:
            self._retired = True

    def leave(self, entry: Entry) -> None:
        with self._lock:
            self.partitions_active -= 1
            self._live.remove(entry)
            self._last_peak = entry.peak

    def sharing(self) -> int:
        """How many partitions share the runtime, for sizing a partition that has entered:
        those running now or, where more, the most that ran beside the partition that left
        last. The first partitions of a burst start before the others have entered; the
        executor that runs them (a worker's threads) is the same as the burst before.

        >>> c = Counters()
        >>> burst = [c.enter() for _ in range(4)]
        >>> for e in burst:
        ...     c.leave(e)
        >>> first = c.enter()
        >>> c.sharing()  # alone for now, after a burst of four
        4
        >>> c.leave(first)
        >>> alone = c.enter()
        >>> c.sharing()  # the partition before ran alone
        1
        """
        with self._lock:
            return max(self.partitions_active, self._last_peak)

    def settle(self, amounts: dict[str, float], window: int, busy: dict[str, float]) -> None:
        """A partition's tallies at its end, under one lock: ``amounts`` added, the most
        sub-chunks its window held (``window``) and its stages' busy seconds."""
        with self._lock:
            self._add(amounts)
            self.max_window = max(self.max_window, window)
            for stage, s in busy.items():
                self.busy_seconds[stage] = self.busy_seconds.get(stage, 0.0) + s

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            out = {
                f.name: getattr(self, f.name)
                for f in dataclasses.fields(self)
                if not f.name.startswith("_")
            }
            out["busy_seconds"] = dict(self.busy_seconds)
            return out
