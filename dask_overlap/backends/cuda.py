"""The ``cuda`` backend: CuPy streams, an RMM pinned host pool and an RMM device pool.

What each piece is for, and the orderings it relies on:

- **Streams** are non-blocking CuPy streams, made once per process and reused by every
  runtime (the comment above ``_take_stream`` says why none is destroyed).
  :meth:`CudaStream.submit` runs the work function on the caller's thread inside
  ``with stream:``, so it only *enqueues*; the runner's next stage on the same stream is
  ordered after it by the stream itself.
  :meth:`CudaStream.on_complete` records a blocking-sync event and hands it to the
  stream's waiter thread, which sleeps in ``cudaEventSynchronize`` (no spinning CPU) and
  then calls the callback. So completion callbacks run on an ordinary Python thread, never
  on a CUDA driver thread.
- **Pinned host pool**: ``rmm.mr.PoolMemoryResource`` over
  ``rmm.mr.PinnedHostMemoryResource``, with its whole size (``overlap.pinned-pool-size``)
  allocated once, when the backend is built: no ``cudaHostAlloc`` per call. Blocks are
  handed out as zero-copy NumPy views; a block goes back to RMM when its last view is
  collected (:class:`~dask_overlap.backends.base.HostPool`). RMM's pool is stream-ordered
  and so protects GPU work, never the host: the runner keeps every buffer of a sub-chunk
  until the event recorded after its copy-out has completed, and only then lets go.
- **Device pool**: one ``rmm.mr.PoolMemoryResource`` per process and device, installed as
  CuPy's allocator (``rmm.allocators.cupy``), so kernels and copies pay no ``cudaMalloc``
  per sub-chunk. CuPy's allocator is process-global, so this pool is too: it is created by
  the first backend and kept for the life of the process (arrays made from it may outlive
  any runtime). Work whose device memory ends with its partition (every ``out`` but
  ``"device"``) allocates inside :meth:`CudaBackend.scratch`: blocks of up to 32 MiB come
  from a cache over that pool that makes no call into RMM or the driver, emptied into it
  once no partition has run for a moment.

Nothing here touches CUDA at import time; everything is created by :class:`CudaBackend`.
"""

from __future__ import annotations

import functools
import itertools
import logging
import math
import queue
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

import cupy
import numpy as np
import rmm
import rmm.mr
from rmm.allocators.cupy import rmm_cupy_allocator
from rmm.pylibrmm.device_buffer import DeviceBuffer
from rmm.pylibrmm.stream import Stream as RmmStream

from ..config import Options
from ..process import Registry
from .base import HostPool, OnDone, requested_bytes
from .cuda_trace import EventTrace

__all__ = ["CudaBackend", "CudaStream", "PinnedPool"]

logger = logging.getLogger(__name__)
_ALIGN = 256  # RMM pools want sizes in multiples of this
_H2D = 1  # cudaMemcpyHostToDevice
_D2H = 2  # cudaMemcpyDeviceToHost
_STOP = object()
#: Timing events kept for reuse once resolved (four per sub-chunk in flight).
_SPARE_MARKS = 1024
#: Arrays whose pinnedness is remembered (see CudaBackend.is_pinned).
_PINNED_ROOTS = 4096
#: The largest block the caches serve (device scratch, kept pinned blocks): a call into
#: RMM costs tens of microseconds, which matters beside the copy of a block of a few MiB
#: and not beside one of 64 MiB (about a millisecond over PCIe); and blocks of the large
#: sizes that change with the partitions running would fragment the pools they keep.
_CACHED_BYTES = 32 * 2**20


def _align_up(n: int) -> int:
    return (int(n) + _ALIGN - 1) // _ALIGN * _ALIGN


def _rows(a: np.ndarray) -> tuple[int, int, int] | None:
    """``a``'s memory as ``(height, width_bytes, pitch_bytes)`` rows, or ``None``.

    Any slice of a C-contiguous array along one axis (a sub-chunk of a partition split
    along axis 1, say) is such a 2-D region, which ``cudaMemcpy2DAsync`` copies directly.
    """
    dims = [(n, s) for n, s in zip(a.shape, a.strides, strict=True) if n != 1]
    width = a.itemsize
    i = len(dims) - 1
    while i >= 0 and dims[i][1] == width:
        width *= dims[i][0]
        i -= 1
    if i < 0:
        return 1, width, width
    height, pitch = dims[i]
    i -= 1
    while i >= 0 and dims[i][1] == pitch * height:
        height *= dims[i][0]
        i -= 1
    if i >= 0 or pitch < width:
        return None  # overlapping, reversed or irregular strides
    return height, width, pitch


def _copy_rows(
    dst: int, dpitch: int, src: int, spitch: int, width: int, height: int, kind: int, stream: Any
) -> None:
    """``height`` runs of ``width`` bytes, ``spitch`` apart from ``src`` and ``dpitch``
    apart at ``dst``, on ``stream``: one ``cudaMemcpyAsync`` when they are one run, else
    one ``cudaMemcpy2DAsync``. Asynchronous where the host side is pinned."""
    if height == 1:
        cupy.cuda.runtime.memcpyAsync(dst, src, width, kind, stream.ptr)
    else:
        cupy.cuda.runtime.memcpy2DAsync(dst, dpitch, src, spitch, width, height, kind, stream.ptr)


class _Span:
    """Pointer and size, as ``cupy.cuda.PinnedMemoryPointer`` wants its ``mem``."""

    __slots__ = ("ptr", "size")

    def __init__(self, ptr: int, size: int):
        self.ptr = ptr
        self.size = size


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
_streams: Registry[tuple[str, int], Any] = Registry("cuda streams")


def _take_stream(device_id: int) -> Any:
    """A non-blocking CuPy stream on ``device_id`` for a runtime, new or given back."""
    with _streams.lock:
        free = _streams.items.setdefault(("free", device_id), [])
        if free:
            return free.pop()
        with cupy.cuda.Device(device_id):
            stream = cupy.cuda.Stream(non_blocking=True)
        _streams.items.setdefault(("made", device_id), []).append(stream)
        _streams.items[("rmm", stream.ptr)] = (RmmStream(obj=stream), device_id)
        return stream


def _give_back_stream(device_id: int, stream: Any) -> None:
    with _streams.lock:
        _streams.items.setdefault(("free", device_id), []).append(stream)


def _pool_stream(device_id: int) -> Any:
    """The one stream on which every pinned pool of ``device_id`` allocates and frees."""
    with _streams.lock:
        stream = _streams.items.get(("pool", device_id))
    if stream is None:
        mine = _take_stream(device_id)
        with _streams.lock:
            stream = _streams.items.setdefault(("pool", device_id), mine)
        if stream is not mine:
            _give_back_stream(device_id, mine)
    return stream


class PinnedPool(HostPool):
    """A :class:`HostPool` whose blocks are pinned memory from an RMM pool.

    A block of up to 32 MiB given back is kept for the next request of its size (every
    partition of an array asks for the same sizes), when the pool has room for many of
    them (kept blocks take a quarter of it at most, so that they cannot fragment it), so
    that the usual small block costs no call into RMM, where calls from several threads
    wait for each other: 55 µs a block with four threads at it, where one thread takes
    13 (``benchmarks/diagnostics/call_costs.py``, H200). Kept blocks are still RMM's, inside its
    fixed size: when RMM cannot serve a request, they all go back to it and it is asked
    again. The pool's budget (``HostPool``) is charged as before, so kept blocks never
    count as in use.

    Parameters
    ----------
    limit
        Bytes; the RMM pool is allocated at this size once, up front.
    device_id
        The device whose context allocates the pinned memory.
    """

    def __init__(self, limit: int, device_id: int):
        super().__init__(limit)
        self.device_id = device_id
        self._device = cupy.cuda.Device(device_id)
        self.mr: Any = None
        self._stream: Any = None
        # nbytes -> addresses of blocks given back, for the next request of that size
        self._kept: dict[int, list[int]] = {}
        # Their bytes (charged as RMM charges them); updated without a lock, so only a
        # hint (see _from_rmm), counted afresh whenever the kept blocks go back.
        self._kept_bytes = 0
        self._size = size = _align_up(self.limit)
        if self.limit > 0:
            with cupy.cuda.Device(device_id):
                self.mr = rmm.mr.PoolMemoryResource(
                    rmm.mr.PinnedHostMemoryResource(),
                    initial_pool_size=size,
                    maximum_pool_size=size,
                )
            # All allocations and frees on one stream: RMM keys its free lists by
            # stream (and by thread for the default stream), so one stream lets any
            # thread reuse any freed block at once, with no cross-stream event waits.
            self._stream = _streams.items[("rmm", _pool_stream(device_id).ptr)][0]

    def charge(self, nbytes: int) -> int:
        # RMM rounds every block up to its alignment: charge that, so that the pool's
        # budget never lets RMM run past its fixed size.
        return _align_up(nbytes)

    def _raw(self, nbytes: int) -> tuple[np.ndarray, Callable[[], None] | None]:
        if nbytes == 0:
            return np.empty(0, np.uint8), None
        if self.mr is None:
            raise MemoryError("the pinned pool has size 0")
        try:
            ptr = self._kept[nbytes].pop()  # (list.pop is atomic: no lock needed)
            self._kept_bytes -= _align_up(nbytes)
        except (KeyError, IndexError):
            ptr = self._from_rmm(nbytes)
        view = np.frombuffer(cupy.cuda.PinnedMemoryPointer(_Span(ptr, nbytes), 0), np.uint8, nbytes)
        # The bound method keeps this pool (and its RMM pool) alive until its last block
        # has gone back.
        return view, functools.partial(self._keep, nbytes, ptr)

    def _from_rmm(self, nbytes: int) -> int:
        if self.in_use + self._kept_bytes > self._size:
            # What is charged (this block included) and what is kept do not fit together:
            # the kept blocks go back first, rather than RMM failing (and logging it).
            self._release_kept()
        for again in (False, True):
            try:
                with self._device:
                    return self.mr.allocate(nbytes, self._stream)
            except Exception as e:
                # Out of pool, or fragmented: once more after giving the kept blocks back,
                # if there were any; else the caller falls back (counted).
                if again or not self._release_kept():
                    raise MemoryError(f"pinned pool could not serve {nbytes} bytes: {e}") from e
        raise AssertionError("not reached")

    def _keep(self, nbytes: int, ptr: int) -> None:
        charged = _align_up(nbytes)
        if (
            nbytes > _CACHED_BYTES
            or charged * 64 > self._size  # a pool with room for few such blocks
            or self._kept_bytes + charged > self._size // 4
        ):
            self.mr.deallocate(ptr, nbytes, self._stream)
            return
        self._kept.setdefault(nbytes, []).append(ptr)
        self._kept_bytes += charged

    def _release_kept(self) -> int:
        """Give every kept block back to RMM; how many there were."""
        released = 0
        for nbytes, ptrs in list(self._kept.items()):
            while True:
                try:
                    ptr = ptrs.pop()
                except IndexError:
                    break
                self.mr.deallocate(ptr, nbytes, self._stream)
                released += 1
        # Counted afresh (a hint, updated without a lock by finalizers on any thread: a
        # drift would only cost speed, and ends here).
        self._kept_bytes = sum(_align_up(n) * len(p) for n, p in list(self._kept.items()))
        return released

    def reserved(self) -> int:
        """Bytes of pinned memory the RMM pool holds (its fixed size)."""
        return 0 if self.mr is None else int(self.mr.pool_size())

    def close(self) -> None:
        if self.mr is not None:
            self._release_kept()


class CudaStream:
    """A non-blocking CUDA stream plus a waiter thread for completion callbacks."""

    def __init__(self, device_id: int, name: str):
        self.device_id = device_id
        self._device = cupy.cuda.Device(device_id)
        self.cupy = _take_stream(device_id)
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
        _give_back_stream(self.device_id, self.cupy)


#: device id -> the RMM device resource this process allocates from (see _device_pool).
_device_pools: Registry[int, Any] = Registry("cuda device pools")
#: device id -> the cache of transient device memory over that resource (see _Scratch).
_scratch_caches: Registry[int, Any] = Registry("cuda scratch caches")


class _ScratchScope(threading.local):
    """Whether this thread's allocations on a stream of ours are transient (see _Scratch)."""

    on = False


_scope = _ScratchScope()


class _Scratch:
    """Entered around work whose device memory is all let go of when its partition ends
    (``out`` other than ``"device"``): its inputs, ``func``'s temporaries and results.

    Inside it, CuPy allocations of up to 32 MiB (``_CACHED_BYTES``) on a stream of ours
    come from a cache, CuPy's own ``MemoryPool`` over the RMM resource: a block freed
    goes back to the cache of the stream it was allocated on, and the next allocation of
    that size on that stream takes it, with no call into RMM or the driver. On four
    threads such a call costs 10 µs of wall where an RMM allocation costs 130-190
    (``benchmarks/diagnostics/call_costs.py``, H200): calls into RMM and the driver from several
    threads wait for each other. The cache only ever holds blocks of work that has
    ended, so it is emptied into RMM once no partition has run for a moment (the
    runtime's trimmer calls :meth:`CudaBackend.trim`), and when RMM is short of memory.
    """

    __slots__ = ()

    def __enter__(self) -> None:
        _scope.on = True

    def __exit__(self, *exc: object) -> None:
        _scope.on = False


_SCRATCH = _Scratch()


def _block(nbytes: int, ours: tuple[Any, int]) -> Any:
    """``nbytes`` from the RMM resource, on the stream of ours whose RMM wrapper and
    device are ``ours``, as a CuPy memory pointer."""
    buf = DeviceBuffer(size=nbytes, stream=ours[0])
    mem = cupy.cuda.UnownedMemory(buf.ptr, buf.size, buf, ours[1])
    return cupy.cuda.MemoryPointer(mem, 0)


def _current_ours() -> tuple[Any, int] | None:
    """The RMM wrapper and device of the current stream, when it is one of ours."""
    return _streams.items.get(("rmm", cupy.cuda.get_current_stream().ptr))


def _refill(nbytes: int) -> Any:
    """The scratch cache's own allocator (a miss): RMM, after emptying the cache into it
    when RMM is short (CuPy's pool frees its cache only for its own error type)."""
    ours = _current_ours()
    if ours is None:  # not reached: the cache is only asked on a stream of ours
        return rmm_cupy_allocator(nbytes)
    try:
        return _block(nbytes, ours)
    except MemoryError:
        _scratch_caches.items[ours[1]].free_all_blocks()
        return _block(nbytes, ours)


def _scratch_cache(device_id: int) -> Any:
    """This process's scratch cache for ``device_id``, made on first use."""
    with _scratch_caches.lock:
        cache = _scratch_caches.items.get(device_id)
        if cache is None:
            cache = _scratch_caches.items[device_id] = cupy.cuda.MemoryPool(_refill)
        return cache


def _allocate(nbytes: int) -> Any:
    """CuPy's allocator: RMM's, with the size of a failed request kept on its error.

    On a stream of ours, what ``rmm_cupy_allocator`` does without its per-call costs: the
    RMM wrapper of the stream is made once, when the stream is, not per allocation (from
    a CuPy stream RMM first tries Numba's stream type, an import and an exception), and
    the device is known, so CuPy need not ask the driver whose pointer it is; inside a
    :class:`_Scratch`, from the scratch cache. On any other stream (a user's, the legacy
    one), ``rmm_cupy_allocator`` itself. RMM's out-of-memory error does not say how much
    was asked for; the runner's error does (see :meth:`CudaBackend.describe_oom`).
    """
    try:
        ours = _current_ours()
        if ours is None:
            return rmm_cupy_allocator(nbytes)
        if _scope.on and nbytes <= _CACHED_BYTES:
            cache = _scratch_caches.items.get(ours[1])
            if cache is not None:
                return cache.malloc(nbytes)
        return _block(nbytes, ours)
    except MemoryError as e:
        if getattr(e, "requested_bytes", None) is None:
            e.requested_bytes = int(nbytes)
        raise


def _device_pool(device_id: int, size: int, resource: str) -> Any:
    """This process's RMM device resource for ``device_id``, CuPy's allocator through it.

    When nobody has set one, a pool of ``size`` bytes made here and set process-wide.
    When one is set already (dask-cuda's ``RMMSetup``, a user's own pool), that one, and
    ``size`` does not apply: a second pool beside it would split the device between two
    owners.
    """
    with _device_pools.lock:
        stats = _device_pools.items.get(device_id)
        current = rmm.mr.get_per_device_resource(device_id)
        if stats is None and type(current) is not rmm.mr.CudaMemoryResource:
            cupy.cuda.set_allocator(_allocate)  # CuPy's arrays into that resource too
            _device_pools.items[device_id] = stats = current
        if stats is None:
            size = _align_up(size)
            with cupy.cuda.Device(device_id):
                # overlap.device-memory-resource: "async" is CUDA's stream-ordered pool
                # (cross-stream reuse tracked by the driver), "pool" RMM's own; "auto"
                # is async here (a UCX worker's plugin resolved it to pool already, see
                # dask_overlap.cluster.ucx.device_memory_resource).
                if resource != "pool":
                    pool = rmm.mr.LimitingResourceAdaptor(
                        rmm.mr.CudaAsyncMemoryResource(
                            initial_pool_size=min(size, _align_up(2 * 2**30)),
                            release_threshold=size,
                        ),
                        allocation_limit=size,
                    )
                else:
                    pool = rmm.mr.PoolMemoryResource(
                        rmm.mr.CudaMemoryResource(),
                        initial_pool_size=min(size, _align_up(2 * 2**30)),
                        maximum_pool_size=size,
                    )
                stats = rmm.mr.StatisticsResourceAdaptor(pool)
                rmm.mr.set_per_device_resource(device_id, stats)
            cupy.cuda.set_allocator(_allocate)
            _device_pools.items[device_id] = stats
        return stats


class CudaBackend:
    """CuPy + RMM; see the module docstring.

    Parameters
    ----------
    options
        ``pinned_pool_size`` bounds the pinned pool, ``device_pool_size`` the device pool.
        The device is the calling thread's current CUDA device.
    """

    name = "cuda"
    host_memory = False
    sampled_timing = True  # each mark is a driver call, and so is reading it

    def __init__(self, options: Options):
        self.options = options
        self.device_id = cupy.cuda.runtime.getDevice()
        self._device = cupy.cuda.Device(self.device_id)
        self._device_mr = _device_pool(
            self.device_id, options.device_pool_size, options.device_memory_resource
        )
        self._scratch = _scratch_cache(self.device_id)
        self.pinned = PinnedPool(options.pinned_pool_size, self.device_id)
        self._names = itertools.count()
        # Timing events around every copy and kernel, for pictures of the assembly line
        # (benchmarks/diagnostics/timeline_cuda.py); off unless started.
        self.trace = EventTrace(self._device)
        self._marks: list[Any] = []  # timing events resolved and free for reuse
        # id(array owning its memory) -> (weakref to it, whether it is pinned)
        self._pinned_roots: dict[int, tuple[weakref.ref, bool]] = {}
        with self._device:
            # The reference that maps event times onto time.time() (see resolve).
            ref = cupy.cuda.Event()
            ref.record(cupy.cuda.Stream.null)
            ref.synchronize()
            self._clock = (ref, time.time())

    # -- streams and memory -----------------------------------------------------------
    def make_stream(self) -> CudaStream:
        return CudaStream(self.device_id, f"overlap-cuda-stream-{next(self._names)}")

    def is_device(self, x: Any) -> bool:
        return isinstance(x, cupy.ndarray)

    def scratch(self) -> _Scratch:
        return _SCRATCH

    def trim(self) -> None:
        # Free blocks only: a block still in use (a partition of another runtime of this
        # process, on this device) stays, and goes back to the cache when it is freed.
        with self._device:
            self._scratch.free_all_blocks()

    def is_pinned(self, x: np.ndarray) -> bool:
        if self.pinned.owns(x):
            return True
        if x.nbytes == 0:
            return False
        # Every view of an array shares its memory's kind: ask the driver once per array
        # that owns its memory (the partitions of one dask array are views of a few).
        root = x
        while isinstance(root.base, np.ndarray):
            root = root.base
        known = self._pinned_roots.get(id(root))
        if known is not None and known[0]() is root:
            return known[1]
        try:  # pinned elsewhere (cupy's pinned pool, cudaHostRegister): no need to stage
            with self._device:
                attrs = cupy.cuda.runtime.pointerGetAttributes(x.ctypes.data)
            pinned = int(attrs.type) == 1  # cudaMemoryTypeHost
        except Exception:
            pinned = False
        if len(self._pinned_roots) >= _PINNED_ROOTS:
            self._pinned_roots.clear()
        try:
            self._pinned_roots[id(root)] = (weakref.ref(root), pinned)
        except TypeError:  # not weakly referenceable: ask again next time
            pass
        return pinned

    def stage(self, src: np.ndarray, dst: np.ndarray) -> None:
        np.copyto(dst, src)

    def unstage(self, src: np.ndarray, dst: np.ndarray) -> None:
        np.copyto(dst, src)

    def device_bytes_in_use(self) -> int | None:
        if not isinstance(self._device_mr, rmm.mr.StatisticsResourceAdaptor):
            return None  # a resource somebody else set, which does not count its bytes
        counts = self._device_mr.allocation_counts
        return int(counts["current_bytes"] if isinstance(counts, dict) else counts.current_bytes)

    def describe_oom(self, error: BaseException) -> str | None:
        if not isinstance(error, MemoryError):
            return None
        nbytes = requested_bytes(error)
        asked = "an unknown number of bytes" if nbytes is None else f"{nbytes:,} bytes"
        if type(error).__module__.startswith("numpy"):  # func's own host allocation
            return f"host memory exhausted when {asked} were asked for"
        return (
            f"device {self.device_id} memory exhausted when {asked} were asked for (the "
            f"device pool's bound is {self.options.device_pool_size:,} bytes: "
            "overlap.device-pool-size)"
        )

    # -- stage timings (for the runtime's timeline) ------------------------------------
    def mark(self, stream: CudaStream) -> Any:
        # Called inside ``submit`` (device set, stream current): a timing event in order,
        # one that an earlier resolve() gave back when there is one.
        try:
            event = self._marks.pop()
        except IndexError:
            event = cupy.cuda.Event()
        event.record(stream.cupy)
        return event

    def resolve(self, marks: list[Any]) -> list[float]:
        # The runner resolves only marks whose stream work has completed, so the events
        # are done; elapsed time from the reference event maps them onto time.time().
        ref, t0 = self._clock
        with self._device:
            times = [t0 + cupy.cuda.get_elapsed_time(ref, m) / 1e3 for m in marks]
        if len(self._marks) < _SPARE_MARKS:
            self._marks.extend(marks)  # read and done with: free for the next marks
        return times

    # -- the three stream stages --------------------------------------------------------
    def copy_in(self, stream: CudaStream, host: Any) -> cupy.ndarray:
        if isinstance(host, cupy.ndarray):
            # Device input needs no copy, but may come from work on the legacy default
            # stream (plain CuPy in another task), which a non-blocking stream does not
            # wait for by itself.
            stream.cupy.wait_event(cupy.cuda.Stream.null.record())
            return host
        if not host.dtype.isnative:
            # CuPy has no non-native byte orders: swap on the host, into a copy kept until
            # the copy-in has completed; func sees the same values in native order.
            host = host.astype(host.dtype.newbyteorder("="))
            stream.keep(host)
        with self.trace.span(stream, "h2d"):
            dev = cupy.empty(host.shape, host.dtype)  # from the RMM pool, on ``stream``
            if host.nbytes == 0:
                return dev
            rows = _rows(host)
            if rows is None:
                # Irregular strides: one contiguous host copy, kept until the copy is done.
                host = np.ascontiguousarray(host)
                stream.keep(host)
                rows = (1, host.nbytes, host.nbytes)
            height, width, pitch = rows
            # Asynchronous when ``host`` is pinned; from pageable memory CUDA stages it
            # itself. Either way ``host`` stays alive: the runner holds a sub-chunk's
            # inputs until its copy-out has completed.
            _copy_rows(dev.data.ptr, width, host.ctypes.data, pitch, width, height, _H2D, stream)
            return dev

    def copy_in_blocks(self, stream: CudaStream, blocks: Any) -> cupy.ndarray:
        with self.trace.span(stream, "h2d"):
            dev = cupy.empty(blocks.shape, blocks.dtype)  # from the RMM pool, on ``stream``
            # Rows along the blocks' axis: each block's part is ``height`` runs of
            # ``width`` bytes, ``pitch`` apart in the block and ``dpitch`` in ``dev``.
            row, axis = blocks.row_bytes, blocks.axis
            height = math.prod(blocks.shape[:axis])
            dpitch = blocks.shape[axis] * row
            base = dev.data.ptr
            for b, lo, hi, at in blocks.parts():
                width = (hi - lo) * row
                src = b.ctypes.data + lo * row  # pinned, C-contiguous: asynchronous
                pitch = b.shape[axis] * row
                _copy_rows(base + at * row, dpitch, src, pitch, width, height, _H2D, stream)
            return dev

    def compute(
        self, stream: CudaStream, func: Callable[..., Any], args: list, kwargs: dict
    ) -> Any:
        with self.trace.span(stream, "compute"):
            # ``func`` may put work on the legacy default stream (a library that ignores
            # CuPy's current stream, a Numba kernel, ``with cupy.cuda.Stream.null``), which
            # our non-blocking streams do not wait for: the copy back (and every free after
            # it) starts after that work. (Making the legacy stream wait for our copy-in as
            # well would chain every stream through it: on the H200 the default path with
            # split_axis fell from 16 to 7.5 GB/s. Like any CuPy code that changes streams,
            # such work must wait for its inputs on the stream it was handed.)
            result = func(*args, **kwargs)
            stream.order_after_legacy()
            return result

    def copy_out(self, stream: CudaStream, device: Any, out: np.ndarray) -> None:
        if out.nbytes == 0:
            return
        with self.trace.span(stream, "d2h"):
            # Enqueued on ``stream`` after the kernel, so it reads the finished result; a
            # temporary made here is freed stream-ordered by RMM.
            src = cupy.ascontiguousarray(device)
            rows = _rows(out)
            if rows is None:
                # Irregular strides in ``out``: land in a temporary, then copy on the host,
                # which needs the copy to have completed.
                tmp = np.empty(out.shape, out.dtype)
                n = tmp.nbytes
                _copy_rows(tmp.ctypes.data, n, src.data.ptr, n, n, 1, _D2H, stream)
                stream.synchronize()
                np.copyto(out, tmp)
                return
            height, width, pitch = rows
            # Straight into the output block (pinned: asynchronous). ``out`` is part of the
            # partition's output, which the runner holds until every copy-out completed.
            _copy_rows(out.ctypes.data, pitch, src.data.ptr, width, width, height, _D2H, stream)

    def empty_device(self, shape: tuple[int, ...], dtype: Any) -> cupy.ndarray:
        # Stream-ordered on the current stream: other streams wait on a mark made after it.
        return cupy.empty(shape, dtype)

    def join_device(self, blocks: tuple[Any, ...], axis: int) -> cupy.ndarray:
        # On the legacy default stream, which copy_in makes a device input wait for.
        with self._device, cupy.cuda.Stream.null:
            return cupy.concatenate([cupy.asarray(b) for b in blocks], axis=axis)

    def wait(self, stream: CudaStream, mark: Any) -> None:
        stream.cupy.wait_event(mark)

    def place(self, stream: CudaStream, device: Any, out: cupy.ndarray) -> None:
        if out.size:
            out[...] = device  # a device-to-device copy kernel on ``stream`` (current)

    def as_result(self, x: Any) -> Any | None:
        # Called in the stream's order (the stream is current): a func that returned host
        # memory gets it copied to the device here, so that every block with out="device"
        # is a CuPy array, as its meta says.
        if isinstance(x, cupy.ndarray):
            return x
        if isinstance(x, (np.ndarray, np.generic)):
            return cupy.asarray(x)
        return None

    def naive(self, func: Callable[..., Any], *blocks: np.ndarray, **kwargs: Any) -> np.ndarray:
        """What the usual code does, on the legacy default stream, one step at a time."""
        null = cupy.cuda.Stream.null
        with self._device, null:
            with self.trace.span(null, "h2d"):
                dev = [cupy.asarray(b) for b in blocks]
            with self.trace.span(null, "compute"):
                out = func(*dev, **kwargs)
            with self.trace.span(null, "d2h"):
                return cupy.asnumpy(out) if isinstance(out, cupy.ndarray) else np.asarray(out)

    def close(self) -> None:
        # Blocks still held (outputs Dask keeps) return to RMM when collected; their
        # give-back closures keep the pinned pool alive until then.
        self.trim()
        self.pinned.close()
