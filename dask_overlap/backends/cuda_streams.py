"""CUDA streams of the cuda backend: made once per process, reused by every runtime.

:meth:`CudaStream.submit` runs the work function on the caller's thread inside
``with stream:``, so it only *enqueues*; the runner's next stage on the same stream is
ordered after it by the stream itself. :meth:`CudaStream.on_complete` records a
blocking-sync event and hands it to the stream's waiter thread, which sleeps in
``cudaEventSynchronize`` (no spinning CPU) and then calls the callback: completion
callbacks run on an ordinary Python thread, never on a CUDA driver thread. (The comment
above ``streams`` says why no stream is destroyed.)
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from typing import Any

import cupy
from rmm.pylibrmm.stream import Stream as RmmStream

from ..process import Registry
from .base import OnDone

__all__ = ["CudaStream", "pool_stream", "streams", "take_stream"]

logger = logging.getLogger(__name__)
_STOP = object()


# CUDA streams live as long as the process; runtimes take them and give them back.
#
# Memory allocated on a stream is freed on that stream: an RMM ``DeviceBuffer`` keeps the
# stream's handle, and an ``rmm...Stream`` wrapper the CuPy stream that owns it. When such
# a buffer ends up in a reference cycle (an exception's traceback holding a device array
# from a failed sub-chunk, say) after its runtime has closed, the garbage collector may
# clear the wrapper first, destroying the stream, and then free the buffer on the dead
# handle: a segfault, seen on the H200 during GPU tests. A stream that is never destroyed
# cannot be used after its destruction; reusing it costs nothing.
# device id -> its free streams ("free"), and the one its pinned pools use ("pool"); every
# stream made also stays in "made", so that none is ever destroyed. ("rmm", its handle)
# -> (the RMM wrapper of a stream made here, its device), for the allocator below.
streams: Registry[tuple[str, int], Any] = Registry("cuda streams")


def take_stream(device_id: int) -> Any:
    """A non-blocking CuPy stream on ``device_id`` for a runtime, new or given back."""
    with streams.lock:
        free = streams.items.setdefault(("free", device_id), [])
        if free:
            return free.pop()
        with cupy.cuda.Device(device_id):
            stream = cupy.cuda.Stream(non_blocking=True)
        streams.items.setdefault(("made", device_id), []).append(stream)
        streams.items[("rmm", stream.ptr)] = (RmmStream(obj=stream), device_id)
        return stream


def give_back_stream(device_id: int, stream: Any) -> None:
    with streams.lock:
        streams.items.setdefault(("free", device_id), []).append(stream)


def pool_stream(device_id: int) -> Any:
    """The one stream on which every pinned pool of ``device_id`` allocates and frees."""
    with streams.lock:
        stream = streams.items.get(("pool", device_id))
    if stream is None:
        mine = take_stream(device_id)
        with streams.lock:
            stream = streams.items.setdefault(("pool", device_id), mine)
        if stream is not mine:
            give_back_stream(device_id, mine)
    return stream


class CudaStream:
    """A non-blocking CUDA stream plus a waiter thread for completion callbacks."""

    def __init__(self, device_id: int, name: str):
        self.device_id = device_id
        self._device = cupy.cuda.Device(device_id)
        self.cupy = take_stream(device_id)
        self.ptr = self.cupy.ptr
        self.name = name
        self._lock = threading.Lock()
        # Host objects an enqueued copy still reads; freed once an event after it completes.
        self._keep: list[Any] = []
        self._error: BaseException | None = None
        self._closed = False
        # Completion events that have fired, for reuse: creating one per sub-chunk costs a
        # driver call (and its destruction another).
        self._events: list[Any] = []
        with self._device:
            self._from_legacy = cupy.cuda.Event(disable_timing=True)
        self._waits: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._wait_loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[[], Any], on_done: OnDone) -> None:
        if self._error is not None:
            on_done(None, self._error)
            return
        try:
            # Every submitter thread sets the device before any CUDA call; ``with stream``
            # makes CuPy (and RMM's CuPy allocator) enqueue on this stream.
            with self._device, self.cupy:
                result = fn()
        except BaseException as e:
            on_done(None, e)
            return
        on_done(result, None)

    def run(self, fn: Callable[[], Any]) -> Any:
        if self._error is not None:
            raise self._error
        with self._device, self.cupy:
            result = fn()
            with self._lock:
                event = self._event()
                event.record(self.cupy)
                keep, self._keep = self._keep, []
        try:
            event.synchronize()  # blocking sync, without the GIL: no waiter-thread hop
        except Exception as e:
            self._error = e
            raise
        self._events.append(event)  # fired: free for the next one
        del keep  # the copies that read it have completed
        return result

    def order_after_legacy(self) -> None:
        """This stream's next work waits for what the legacy default stream has now.

        When that stream has nothing left to do (the usual case: ``func`` did not use it),
        there is nothing to wait for, and one query costs less than an event recorded on
        it and waited for (two driver calls, per partition).
        (Each event is this stream's and is re-recorded by whichever thread comes next: a
        wait captures the event as it is when it is enqueued, so a later record only makes
        a waiter wait for more, never for less.)"""
        legacy = cupy.cuda.Stream.null
        if legacy.done:
            return
        self._from_legacy.record(legacy)
        self.cupy.wait_event(self._from_legacy)

    def _event(self) -> Any:
        """A completion event: one that has fired before, or a new one."""
        try:
            return self._events.pop()
        except IndexError:
            return cupy.cuda.Event(block=True, disable_timing=True)

    def keep(self, obj: Any) -> None:
        """Hold ``obj`` until the next :meth:`on_complete` event has completed."""
        with self._lock:
            self._keep.append(obj)

    def on_complete(self, callback: Callable[[BaseException | None], None]) -> None:
        # Record and take the keep-list together: anything kept before this point was kept
        # after its copy was enqueued, so the event covers that copy.
        with self._lock, self._device:
            event = self._event()
            event.record(self.cupy)
            keep, self._keep = self._keep, []
            if not self._closed and self._thread.is_alive():
                self._waits.put((event, callback, keep))
                return
        # Closed (a runtime closed under a partition still running), or the waiter is
        # gone: wait here rather than never call back.
        error = None
        try:
            event.synchronize()
        except Exception as e:
            error = self._error = e
        del keep
        callback(error or self._error)

    def _wait_loop(self) -> None:
        cupy.cuda.runtime.setDevice(self.device_id)
        while True:
            item = self._waits.get()
            if item is _STOP:
                return
            event, callback, keep = item
            try:
                event.synchronize()  # blocking sync, without the GIL
                self._events.append(event)  # fired: free for the next one
            except Exception as e:  # a sticky CUDA error: this and later work failed
                self._error = e
            # The copies that read ``keep`` have completed; dropping it frees host memory.
            del item, keep, event
            try:
                callback(self._error)
            except BaseException:  # the callback only posts news: never let it end the
                # waiter, or every later completion on this stream would hang; said
                logger.exception("%s: a completion callback raised", self.name)
            finally:
                del callback

    def synchronize(self) -> None:
        with self._device:
            self.cupy.synchronize()

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._waits.put(_STOP)
        self._thread.join()
        give_back_stream(self.device_id, self.cupy)
