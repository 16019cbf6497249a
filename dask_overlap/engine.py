"""The pipeline engine: a state machine with no I/O, no threads and no CuPy.

It plans how a partition splits into sub-chunks and, fed events ("sub-chunk 3 was
staged", "sub-chunk 2 was copied out"), returns the next actions, never admitting more
than ``in_flight`` sub-chunks at once. Backends carry the actions out; the partition
runner (:mod:`dask_overlap.partition`) feeds their completions back as events. Every
ordering rule of the assembly line lives here, so the tests can drive it directly.

Each sub-chunk goes through the stages, in this order::

    STAGE (host copy into pinned memory; only when an input is pageable)
    H2D   (copy to the device)
    COMPUTE (the user's function)
    D2H   (copy into the output)

A sub-chunk is *in flight* from its admission until its D2H completes or it fails.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Sequence

__all__ = [
    "Action",
    "Done",
    "EngineError",
    "Failed",
    "Pipeline",
    "Plan",
    "Stage",
    "SubChunk",
    "plan_sub_chunks",
]


class Stage(enum.IntEnum):
    STAGE = 0
    H2D = 1
    COMPUTE = 2
    D2H = 3


@dataclasses.dataclass(frozen=True)
class SubChunk:
    """Rows ``[start, stop)`` of a partition along the split axis."""

    index: int
    start: int
    stop: int

    @property
    def extent(self) -> int:
        return self.stop - self.start


@dataclasses.dataclass(frozen=True)
class Plan:
    """How one partition is cut: ``axis`` is ``None`` when it is processed whole."""

    axis: int | None
    extent: int
    sub_chunks: tuple[SubChunk, ...]

    def __len__(self) -> int:
        return len(self.sub_chunks)


def plan_sub_chunks(extent: int, row_bytes: int, sub_chunk_bytes: int, axis: int | None) -> Plan:
    """Cut ``extent`` rows of ``row_bytes`` each into sub-chunks of about ``sub_chunk_bytes``.

    The sub-chunks are as even as possible (their extents differ by at most one row) and
    never empty; with ``axis=None`` or nothing to split the partition is one sub-chunk.

    Examples
    --------
    >>> [(s.start, s.stop) for s in plan_sub_chunks(10, 8, 32, axis=0).sub_chunks]
    [(0, 4), (4, 7), (7, 10)]
    """
    if axis is None or extent <= 1 or row_bytes <= 0:
        return Plan(axis, extent, (SubChunk(0, 0, extent),))
    rows = max(1, sub_chunk_bytes // row_bytes)
    n = min(extent, math.ceil(extent / rows))
    base, extra = divmod(extent, n)
    subs = []
    start = 0
    for i in range(n):
        stop = start + base + (1 if i < extra else 0)
        subs.append(SubChunk(i, start, stop))
        start = stop
    return Plan(axis, extent, tuple(subs))


@dataclasses.dataclass(frozen=True)
class Action:
    """Run ``stage`` for sub-chunk ``index``."""

    stage: Stage
    index: int


@dataclasses.dataclass(frozen=True)
class Done:
    """``stage`` of sub-chunk ``index`` is done (for D2H: the data has landed)."""

    stage: Stage
    index: int


@dataclasses.dataclass(frozen=True)
class Failed:
    """``stage`` of sub-chunk ``index`` raised ``error``."""

    stage: Stage
    index: int
    error: BaseException


class EngineError(RuntimeError):
    """An event that breaks the pipeline's protocol (a bug in a backend or the runner)."""


_NEXT = {Stage.STAGE: Stage.H2D, Stage.H2D: Stage.COMPUTE, Stage.COMPUTE: Stage.D2H}


class Pipeline:
    """The bounded assembly line of one partition.

    Parameters
    ----------
    n_sub_chunks
        How many sub-chunks the partition has.
    in_flight
        The window: at most this many sub-chunks are admitted and not yet finished.
    staged
        Whether sub-chunks start with :attr:`Stage.STAGE` (pageable input) or go
        straight to :attr:`Stage.H2D`. A sequence gives the choice per sub-chunk.
    stream_ordered
        When true, H2D, COMPUTE and D2H of a sub-chunk are issued together as soon as it
        is staged: they go to one in-order stream, so the device never waits for the
        submitter between them. Their completions must still arrive in stage order.

    Examples
    --------
    >>> p = Pipeline(3, in_flight=2, staged=False)
    >>> p.start()
    [Action(stage=<Stage.H2D: 1>, index=0), Action(stage=<Stage.H2D: 1>, index=1)]
    >>> p.window_full, p.pending
    (True, 1)
    """

    def __init__(
        self,
        n_sub_chunks: int,
        in_flight: int,
        staged: bool | Sequence[bool],
        stream_ordered: bool = False,
    ):
        if n_sub_chunks < 1:
            raise ValueError(f"n_sub_chunks must be >= 1, got {n_sub_chunks}")
        if in_flight < 1:
            raise ValueError(f"in_flight must be >= 1, got {in_flight}")
        self.n = n_sub_chunks
        self.window = in_flight
        if isinstance(staged, bool):
            staged = [staged] * n_sub_chunks
        self._staged = list(staged)
        self.stream_ordered = stream_ordered
        if len(self._staged) != n_sub_chunks:
            raise ValueError("staged must have one entry per sub-chunk")
        self._next_admit = 0
        # sub-chunk index -> the stage whose completion we wait for
        self._waiting: dict[int, Stage] = {}
        self.completed = 0
        self.failed = 0
        self.error: BaseException | None = None
        self.max_in_flight = 0
        self.history: list[tuple[int, Stage]] = []
        self._started = False

    # -- state -------------------------------------------------------------------------
    @property
    def in_flight(self) -> int:
        return len(self._waiting)

    @property
    def pending(self) -> int:
        """Sub-chunks not admitted yet (zero once the pipeline has failed)."""
        return 0 if self.error is not None else self.n - self._next_admit

    @property
    def window_full(self) -> bool:
        return self.in_flight >= self.window

    @property
    def blocked(self) -> bool:
        """True when work waits only because the window is full: the submitter's wait."""
        return self.window_full and self.pending > 0

    @property
    def done(self) -> bool:
        return self._started and self.in_flight == 0 and self.pending == 0

    # -- transitions -------------------------------------------------------------------
    def start(self) -> list[Action]:
        if self._started:
            raise EngineError("pipeline already started")
        self._started = True
        return self._admit()

    def handle(self, event: Done | Failed) -> list[Action]:
        """Take one event; return the actions it makes possible."""
        expected = self._waiting.get(event.index)
        if expected is None or expected != event.stage:
            raise EngineError(
                f"unexpected {type(event).__name__}({event.stage.name}, {event.index}); "
                f"sub-chunk {event.index} waits for "
                f"{expected.name if expected is not None else 'nothing'}"
            )
        if isinstance(event, Failed):
            del self._waiting[event.index]
            self.failed += 1
            if self.error is None:
                self.error = event.error
            return []
        self.history.append((event.index, event.stage))
        if self.error is not None:
            # Draining after a failure: let what was started finish, start nothing new.
            # Stream-ordered stages already queued behind this one will still report.
            if self.stream_ordered and event.stage in (Stage.H2D, Stage.COMPUTE):
                self._waiting[event.index] = _NEXT[event.stage]
            else:
                del self._waiting[event.index]
            return []
        if event.stage == Stage.D2H:
            del self._waiting[event.index]
            self.completed += 1
            return self._admit()
        nxt = _NEXT[event.stage]
        self._waiting[event.index] = nxt
        if self.stream_ordered and event.stage != Stage.STAGE:
            return []  # already issued with its H2D
        return self._issue(nxt, event.index)

    def _issue(self, stage: Stage, i: int) -> list[Action]:
        if self.stream_ordered and stage == Stage.H2D:
            return [Action(Stage.H2D, i), Action(Stage.COMPUTE, i), Action(Stage.D2H, i)]
        return [Action(stage, i)]

    def _admit(self) -> list[Action]:
        actions = []
        while self.pending and not self.window_full:
            i = self._next_admit
            self._next_admit += 1
            first = Stage.STAGE if self._staged[i] else Stage.H2D
            self._waiting[i] = first
            actions.extend(self._issue(first, i))
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        return actions
