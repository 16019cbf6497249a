"""The pipeline engine: a state machine with no I/O, no threads and no CuPy.

It plans how a partition splits into sub-chunks and, fed events ("sub-chunk 3 was
staged", "sub-chunk 2 was copied out"), returns the next actions, never admitting more
than ``in_flight`` sub-chunks at once. Backends carry the actions out; the partition
runner (:mod:`dask_overlap.pipeline.partition`) feeds their completions back as events. Every
ordering rule of the assembly line lives here, so the tests can drive it directly.

Each sub-chunk goes through the stages, in this order::

    STAGING   (host copy of pageable input into the pinned ring; only when needed)
    H2D       (copy to the device)          \\
    COMPUTE   (the user's function)          > issued together, on one in-order stream
    D2H       (copy into the pinned ring)   /
    UNSTAGING (host copy out of the ring into the result; only when needed)

H2D, COMPUTE and D2H go to one in-order stream, so they are issued together as soon as
the sub-chunk is staged, by one action (``Action(Stage.H2D, i)``: the device work, from
its H2D on): the device never waits for the submitter between them. Their one
completion is the D2H's (which implies the other two); any of the three may instead
fail. One action per piece of work: staging, the device work, unstaging.

A sub-chunk is *in flight* from its admission until its last stage completes or it fails.
Admission is in index order, while the window has room and, when the runner passes an
``admit`` callback, while that callback agrees (the runner's pinned ring has room for
the sub-chunk's buffers): a sub-chunk never holds ring memory while it waits for more.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Callable, Sequence

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
    STAGING = 0
    H2D = 1
    COMPUTE = 2
    D2H = 3
    UNSTAGING = 4


#: The stages issued together on one stream once a sub-chunk is staged.
DEVICE_STAGES = (Stage.H2D, Stage.COMPUTE, Stage.D2H)


@dataclasses.dataclass(frozen=True)
class SubChunk:
    """Rows ``[start, stop)`` of a partition along the split axis: what it writes. What
    it reads, ``[read_start, read_stop)``, may be wider (a halo); by default the same."""

    index: int
    start: int
    stop: int
    read_start: int = -1  # -1: start
    read_stop: int = -1  # -1: stop

    def __post_init__(self) -> None:
        if self.read_start < 0:
            object.__setattr__(self, "read_start", self.start)
        if self.read_stop < 0:
            object.__setattr__(self, "read_stop", self.stop)

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
    """Run ``stage`` for sub-chunk ``index`` (``H2D``: the device work, H2D to D2H)."""

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


def _flags(name: str, value: bool | Sequence[bool], n: int) -> list[bool]:
    if isinstance(value, bool):
        return [value] * n
    flags = list(value)
    if len(flags) != n:
        raise ValueError(f"{name} must have one entry per sub-chunk ({n}), got {len(flags)}")
    return flags


class Pipeline:
    """The bounded assembly line of one partition.

    Parameters
    ----------
    n_sub_chunks
        How many sub-chunks the partition has.
    in_flight
        The window: at most this many sub-chunks are admitted and not yet finished.
    staged
        Whether sub-chunks start with :attr:`Stage.STAGING` (pageable input) or go
        straight to the device stages. A sequence gives the choice per sub-chunk.
    unstaged
        Whether sub-chunks end with :attr:`Stage.UNSTAGING` after their D2H (the output
        lands in the pinned ring and is then copied into the result).
    admit
        ``admit(i)`` says whether sub-chunk ``i`` may be admitted now (the runner's
        pinned ring has room for it). While it refuses, the pipeline is :attr:`stalled`;
        admission resumes on the next completion or on :meth:`retry`.

    Examples
    --------
    >>> p = Pipeline(3, in_flight=2, staged=False)
    >>> [(a.stage.name, a.index) for a in p.start()]
    [('H2D', 0), ('H2D', 1)]
    >>> p.window_full, p.pending
    (True, 1)
    """

    def __init__(
        self,
        n_sub_chunks: int,
        in_flight: int,
        staged: bool | Sequence[bool],
        unstaged: bool | Sequence[bool] = False,
        admit: Callable[[int], bool] | None = None,
    ):
        if n_sub_chunks < 1:
            raise ValueError(f"n_sub_chunks must be >= 1, got {n_sub_chunks}")
        if in_flight < 1:
            raise ValueError(f"in_flight must be >= 1, got {in_flight}")
        self.n = n_sub_chunks
        self.window = in_flight
        self._staged = _flags("staged", staged, n_sub_chunks)
        self._unstaged = _flags("unstaged", unstaged, n_sub_chunks)
        self._admit_ok = admit
        self._next_admit = 0
        # sub-chunk index -> the stage whose completion we wait for
        self._waiting: dict[int, Stage] = {}
        self.completed = 0
        self.failed = 0
        self.failure: Failed | None = None  # the first failure; the pipeline drains after it
        self.max_in_flight = 0
        self.stalled = False
        self._started = False

    # -- state -------------------------------------------------------------------------
    @property
    def error(self) -> BaseException | None:
        """The first failure's error (``None`` while nothing failed)."""
        return None if self.failure is None else self.failure.error

    @property
    def in_flight(self) -> int:
        return len(self._waiting)

    @property
    def pending(self) -> int:
        """Sub-chunks not admitted yet (zero once the pipeline has failed)."""
        return 0 if self.failure is not None else self.n - self._next_admit

    @property
    def window_full(self) -> bool:
        return self.in_flight >= self.window

    @property
    def blocked(self) -> bool:
        """True when work waits only because the window is full or the ring refused it:
        the submitter's wait (backpressure)."""
        return self.pending > 0 and (self.window_full or self.stalled)

    @property
    def done(self) -> bool:
        return self._started and self.in_flight == 0 and self.pending == 0

    # -- transitions -------------------------------------------------------------------
    def start(self) -> list[Action]:
        if self._started:
            raise EngineError("pipeline already started")
        self._started = True
        return self._admit()

    def retry(self) -> list[Action]:
        """Ask ``admit`` again (the runner saw room appear in its ring)."""
        return self._admit() if self._started else []

    def handle(self, event: Done | Failed) -> list[Action]:
        """Take one event; return the actions it makes possible."""
        i = event.index
        expected = self._waiting.get(i)
        allowed = expected == event.stage or (
            isinstance(event, Failed) and expected == Stage.D2H and event.stage in DEVICE_STAGES
        )
        if not allowed:
            raise EngineError(
                f"unexpected {type(event).__name__}({event.stage.name}, {i}); "
                f"sub-chunk {i} waits for {expected.name if expected is not None else 'nothing'}"
            )
        if isinstance(event, Failed):
            del self._waiting[i]
            self.failed += 1
            if self.failure is None:
                self.failure = event
            return []
        if self.failure is not None:
            # Draining after a failure: what was started has finished its current stage;
            # start nothing new, not even this sub-chunk's next stage.
            del self._waiting[i]
            return []
        if event.stage == Stage.STAGING:
            self._waiting[i] = Stage.D2H
            return [Action(Stage.H2D, i)]
        if event.stage == Stage.D2H and self._unstaged[i]:
            self._waiting[i] = Stage.UNSTAGING
            return [Action(Stage.UNSTAGING, i)]
        del self._waiting[i]
        self.completed += 1
        return self._admit()

    def _admit(self) -> list[Action]:
        actions: list[Action] = []
        self.stalled = False
        while self.pending and not self.window_full:
            i = self._next_admit
            if self._admit_ok is not None and not self._admit_ok(i):
                self.stalled = True
                break
            self._next_admit += 1
            if self._staged[i]:
                self._waiting[i] = Stage.STAGING
                actions.append(Action(Stage.STAGING, i))
            else:
                self._waiting[i] = Stage.D2H
                actions.append(Action(Stage.H2D, i))
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        return actions
