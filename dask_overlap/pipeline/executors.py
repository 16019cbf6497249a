"""How a partition's stages run: on the task's own thread, or handed to other threads.

The driver (:mod:`.partition`) gives an executor each action the engine returns
(:meth:`start`) and asks it for the next completion (:meth:`next_event`); the work itself
is the partition's (:class:`~.work.PartitionWork`). Two executors, one interface:

- :class:`InlineExecutor` runs each action to completion on the task's thread, for a
  partition of one sub-chunk: nothing of it can overlap anything else of it, so a hand-off
  to another thread would only add its cost (small partitions spend most of their time on
  the host). Copies too large for one thread still go to the copy threads, and it waits.
- :class:`ThreadedExecutor` hands staging and unstaging to the copy threads and the
  device work to a stream; their completions come back through a queue, from the thread
  that saw them complete.

Both hold every stream a sub-chunk leased until its D2H has completed, and after a
failure :meth:`drain` waits, with a deadline, until those streams are done: no buffer is
let go under an asynchronous copy.
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from ..backends import Stream
from .engine import Action, Done, Failed, Stage
from .work import PartitionWork

__all__ = ["InlineExecutor", "StalledError", "ThreadedExecutor"]

logger = logging.getLogger(__name__)

Event = Done | Failed


class StalledError(TimeoutError):
    """No completion came for ``overlap.stall-timeout``: a stream or a copy is stuck."""


class _Executor:
    """What both executors share: the streams leased, and draining them."""

    def __init__(self, work: PartitionWork, stall_timeout: float):
        self.work = work
        self.stall_timeout = stall_timeout
        self.leased: dict[int, Stream] = {}  # sub-chunk -> its stream, until its D2H completed
        self.used: dict[int, Stream] = {}  # id(stream) -> stream: every stream enqueued on
        self.started: dict[int, float] = {}  # sub-chunk -> when its device work began

    def _lease(self, i: int) -> Stream:
        rt, work = self.work.rt, self.work
        stream = work.subs[i].stream = rt.acquire_stream()
        self.leased[i] = stream
        self.used[id(stream)] = stream
        self.started[i] = time.time()
        work.device_delta += work.subs[i].h2d_bytes
        work.subs[i].on_device = True
        return stream

    def device_done(self, i: int) -> None:
        """Sub-chunk ``i``'s D2H has completed: its stream goes back, its buffers go."""
        self.work.rt.release_stream(self.leased.pop(i))
        self.work.device_done(i, self.started.pop(i))

    def drain(self) -> bool:
        """After a failure: wait until every stream this partition used has completed
        what it enqueued, then give back the leases still held. ``False`` when a stream
        did not complete within the stall timeout: its buffers must then be kept."""
        streams = list(self.used.values())
        done = threading.Semaphore(0)
        for s in streams:
            s.on_complete(lambda _error: done.release())
        deadline = time.monotonic() + self.stall_timeout
        for _ in streams:
            if not done.acquire(timeout=max(0.0, deadline - time.monotonic())):
                logger.error(
                    "%s: a stream did not complete within overlap.stall-timeout (%.0f s) "
                    "after a failure; its buffers are kept, not freed under a copy",
                    self.work.where,
                    self.stall_timeout,
                )
                return False
        for stream in self.leased.values():
            self.work.rt.release_stream(stream)
        self.leased.clear()
        return True


class InlineExecutor(_Executor):
    """Each action to completion on the calling thread (see the module docstring)."""

    def __init__(self, work: PartitionWork, stall_timeout: float):
        super().__init__(work, stall_timeout)
        self._ready: collections.deque[Event] = collections.deque()

    def start(self, action: Action) -> None:
        work, i, stage = self.work, action.index, action.stage
        sub = work.subs[i]
        try:
            if stage == Stage.STAGING:
                sub.stage_now = Stage.STAGING
                self._copy(i, stage, work.stage_copies(i), work.backend.host_copy)
                done = Stage.STAGING
            elif stage == Stage.H2D:
                stream = self._lease(i)
                stream.run(work.device_work(i, stream, work.timed(i)))
                done = Stage.D2H
            else:
                sub.stage_now = Stage.UNSTAGING
                self._copy(i, stage, work.unstage_copies(i), work.backend.host_copy)
                done = Stage.UNSTAGING
        except BaseException as e:  # func's Ctrl-C too: the driver drains and re-raises
            self._ready.append(Failed(sub.stage_now, i, e))
        else:
            self._ready.append(Done(done, i))

    def _copy(self, i: int, stage: Stage, copies: list, fn: Callable) -> None:
        if not copies:
            return
        t0 = time.time()
        self.work.rt.copies.run(copies, fn)
        nbytes = sum(s.nbytes for s, _ in copies)
        self.work.subs[i].spans.append((stage.name.lower(), t0, time.time(), nbytes))

    def next_event(self) -> Event:
        # Every action started has completed already: its event is here.
        return self._ready.popleft()


class ThreadedExecutor(_Executor):
    """Actions handed to the copy threads and the streams (see the module docstring)."""

    def __init__(self, work: PartitionWork, stall_timeout: float):
        super().__init__(work, stall_timeout)
        self._events: queue.SimpleQueue[Event] = queue.SimpleQueue()
        self._failed: set[int] = set()  # sub-chunks a stage of which failed

    def _post(self, event: Event) -> None:
        if isinstance(event, Failed):
            self._failed.add(event.index)
        self._events.put(event)

    def start(self, action: Action) -> None:
        i, stage, work = action.index, action.stage, self.work
        if i in self._failed:
            return  # an earlier stage of it failed; the engine has its Failed event
        try:
            if stage == Stage.STAGING:
                self._copy(i, stage, work.stage_copies(i), work.backend.host_copy)
            elif stage == Stage.H2D:
                self._device(i)
            else:
                self._copy(i, stage, work.unstage_copies(i), work.backend.host_copy)
        except Exception as e:
            self._post(Failed(stage, i, e))

    def next_event(self) -> Event:
        try:
            return self._events.get(timeout=self.stall_timeout)
        except queue.Empty:
            raise StalledError(
                f"{self.work.where}: no stage of its sub-chunks in flight completed within "
                f"overlap.stall-timeout ({self.stall_timeout:.0f} s)"
            ) from None

    def _callback(self, i: int, stage: Stage, fn: Callable[..., None]) -> Callable[..., None]:
        """``fn`` to be called back from another thread for sub-chunk ``i``: should it raise,
        the sub-chunk fails with that error, rather than leave the driver waiting for an
        event that would never come."""

        def call(*args: Any) -> None:
            try:
                fn(*args)
            except BaseException as e:
                self._post(Failed(stage, i, e))

        return call

    def _copy(self, i: int, stage: Stage, copies: list, fn: Callable) -> None:
        """``copies`` of sub-chunk ``i`` on the copy threads; ``stage`` is done when all are
        (a Done event, from the thread that finished the last piece)."""
        if not copies:
            self._post(Done(stage, i))
            return
        sub = self.work.subs[i]
        nbytes = sum(src.nbytes for src, _ in copies)
        t0 = time.time()

        def done(error: BaseException | None) -> None:
            if error is not None:
                self._post(Failed(stage, i, error))
                return
            sub.spans.append((stage.name.lower(), t0, time.time(), nbytes))
            self._post(Done(stage, i))

        self.work.rt.copies.copy(copies, fn, self._callback(i, stage, done))

    def _device(self, i: int) -> None:
        """H2D, COMPUTE and D2H of sub-chunk ``i``, enqueued together on one stream; its
        completion comes back as one D2H event, from the stream's waiter."""
        sub, work = self.work.subs[i], self.work
        stream = self._lease(i)

        def completed(error: BaseException | None) -> None:
            self._post(Failed(Stage.D2H, i, error) if error else Done(Stage.D2H, i))

        def issued(_: Any, error: BaseException | None) -> None:
            if error is not None:
                self._post(Failed(sub.stage_now, i, error))
            else:
                stream.on_complete(self._callback(i, Stage.D2H, completed))

        timed = work.timed(i)
        stream.submit(work.device_work(i, stream, timed), self._callback(i, Stage.H2D, issued))
