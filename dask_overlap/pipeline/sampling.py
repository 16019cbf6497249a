"""Which partitions and sub-chunks are timed on the device, and the others' spans.

On CUDA, timing one partition's three stream stages takes four events recorded in its
stream's order and four elapsed times read back: eight of the fifteen or so calls into
the driver that a one-sub-chunk partition makes. Each such call gives the GIL up and
then waits to get it back behind the other task threads. On an H200 with 16 MiB
partitions on four Dask threads, the task threads spent 17% of their time in those
eight calls, most of it waiting for the GIL (``py-spy record --native --idle``, see
``benchmarks/diagnostics/spy_summary.py``); a copy of 16 MiB takes about 300 µs.

So the lean path times a partition's stages only now and then: the first partitions of
each ``map_blocks`` call, then one every :data:`SAMPLE_SECONDS` per call, and every
partition that moves :data:`ALWAYS_TIMED_BYTES` or more (beside whose copies the timing
cost nothing measurable: ``benchmarks/diagnostics/timing_threshold.py``). A partition
that is not timed still reaches the timeline, the busy seconds and the task's fine
metrics, with *estimated* spans: each stage takes what it took in the call's last timed
partition, scaled by its bytes, one after the other from the moment the partition was
handed to its stream. Partitions of one call run the same ``func`` on blocks of the same
shape, so the estimate follows the last measurement; the bytes moved are always the real
ones.

The sub-chunks of a partition cut into several (the engine's path) are sampled the same
way, whatever their size: the first ones of a call, then one every
:data:`SAMPLE_SECONDS`. There the four events go to several streams at once, each
sub-chunk's completion comes back through a waiter thread, and the task thread that
records and reads them is the one that must issue the next sub-chunk in time to keep both
copy engines fed. On an H200 the opt-in pinned path ran 0.882 of its bound sampled, 0.854
with every sub-chunk timed and 0.900 with none (means of eight rounds in turn,
``benchmarks/diagnostics/copy_streams.py --timing``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

__all__ = ["ALWAYS_TIMED_BYTES", "SAMPLE_SECONDS", "StageSampler"]

#: Seconds between two timed partitions of one ``map_blocks`` call.
SAMPLE_SECONDS = 0.01
#: Input bytes from which every partition is timed.
ALWAYS_TIMED_BYTES = 32 * 2**20
#: Calls remembered at once: past it, they are all forgotten (and timed afresh).
_CALLS = 256

Spans = list[tuple[str, float, float, int]]


class StageSampler:
    """Per ``map_blocks`` call (a partition key's name): when its next partition is timed,
    and what its last timed partition's stages took (see the module docstring).

    Shared by the task threads of a runtime, without a lock: a race costs at most one
    partition timed more than needed.

    Examples
    --------
    >>> s = StageSampler()
    >>> s.due("y", 1000, now=0.0)  # nothing learned yet for "y"
    True
    >>> s.learn("y", [("h2d", 1.0, 1.5, 1000), ("compute", 1.5, 2.0, 1000)])
    >>> [s.due("y", 1000, now=t) for t in (0.001, 0.005, 0.02)]  # one per 10 ms
    [False, False, True]
    >>> s.due("y", 2**30, now=0.021)  # large: always timed
    True
    >>> s.due("y", 2**30, now=0.022, cut=True)  # but a sub-chunk of a cut one is sampled
    False
    >>> s.estimate("y", 10.0, {"h2d": 500, "compute": 500})
    [('h2d', 10.0, 10.25, 500), ('compute', 10.25, 10.5, 500)]
    """

    def __init__(self) -> None:
        self._learned: dict[Any, tuple[tuple[str, float, int], ...]] = {}
        self._timed_at: dict[Any, float] = {}  # when the call's last timed partition began

    def due(self, name: Any, nbytes: int, now: float, cut: bool = False) -> bool:
        """Whether the partition of call ``name`` that moves ``nbytes`` in, starting at
        ``now`` (``time.monotonic()``), has its stages timed; if so, the next one of the
        call is not before :data:`SAMPLE_SECONDS`. With ``cut``, it is a sub-chunk of a
        partition cut into several: sampled whatever its size (see the module docstring)."""
        if nbytes >= ALWAYS_TIMED_BYTES and not cut:
            return True
        last = self._timed_at.get(name)
        if last is not None and now - last < SAMPLE_SECONDS and name in self._learned:
            return False
        if len(self._timed_at) >= _CALLS and name not in self._timed_at:
            self._timed_at.clear()  # calls that never got as far as learn()
        self._timed_at[name] = now
        return True

    def learn(self, name: Any, spans: Iterable[tuple[str, float, float, int]]) -> None:
        """Call ``name``'s latest timed stages, ``(stage, start, end, nbytes)`` in order."""
        if len(self._learned) >= _CALLS and name not in self._learned:
            self._learned.clear()
            self._timed_at.clear()
        self._learned[name] = tuple((stage, end - start, n) for stage, start, end, n in spans)

    def estimate(self, name: Any, start: float, nbytes: Mapping[str, int]) -> Spans:
        """Estimated spans of an untimed partition of call ``name``, from ``start`` on: each
        stage as long as last measured, scaled by its bytes (``nbytes[stage]``)."""
        spans: Spans = []
        t = start
        for stage, seconds, n in self._learned.get(name, ()):
            b = nbytes.get(stage, n)
            took = seconds * b / n if n else seconds
            spans.append((stage, t, t + took, b))
            t += took
        return spans
