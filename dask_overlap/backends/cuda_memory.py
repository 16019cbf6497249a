"""Memory of the cuda backend: the pinned host pool, the device pool and its scratch cache.

- **Pinned host pool** (:class:`PinnedPool`): ``rmm.mr.PoolMemoryResource`` over
  ``rmm.mr.PinnedHostMemoryResource``, with its whole size (``overlap.pinned-pool-size``)
  allocated once, when the backend is built: no ``cudaHostAlloc`` per call. Blocks are
  handed out as zero-copy NumPy views; a block goes back to RMM when its last view is
  collected (:class:`~dask_overlap.backends.base.HostPool`). RMM's pool is stream-ordered
  and so protects GPU work, never the host: the runner keeps every buffer of a sub-chunk
  until the event recorded after its copy-out has completed, and only then lets go.
- **Device pool** (:func:`device_pool`): one RMM resource per process and device,
  installed as CuPy's allocator, so kernels and copies pay no ``cudaMalloc`` per
  sub-chunk. CuPy's allocator is process-global, so this pool is too: it is created by
  the first backend (the runtime's, which a worker plugin builds in ``setup``, as
  dask-cuda's ``RMMSetup`` sets RMM up there) and kept for the life of the process.
  Work whose device memory ends with its partition allocates inside :data:`SCRATCH`:
  blocks of up to 32 MiB come from a cache over that pool that makes no call into RMM or
  the driver, emptied into it once no partition has run for a moment.

Nothing here touches CUDA at import time.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any

import cupy
import numpy as np
import rmm
import rmm.mr
from rmm.allocators.cupy import rmm_cupy_allocator
from rmm.pylibrmm.device_buffer import DeviceBuffer

from ..process import Registry
from .base import HostPool
from .cuda_streams import pool_stream, streams

__all__ = ["CACHED_BYTES", "PinnedPool", "SCRATCH", "align_up", "device_pool", "scratch_cache"]


_ALIGN = 256  # RMM pools want sizes in multiples of this


def align_up(n: int) -> int:
    return (int(n) + _ALIGN - 1) // _ALIGN * _ALIGN


#: The largest block the caches serve (device scratch, kept pinned blocks): a call into
#: RMM costs tens of microseconds, which matters beside the copy of a block of a few MiB
#: and not beside one of 64 MiB (about a millisecond over PCIe); and blocks of the large
#: sizes that change with the partitions running would fragment the pools they keep.
CACHED_BYTES = 32 * 2**20


class _Span:
    """Pointer and size, as ``cupy.cuda.PinnedMemoryPointer`` wants its ``mem``."""

    __slots__ = ("ptr", "size")

    def __init__(self, ptr: int, size: int):
        self.ptr = ptr
        self.size = size


class _QuietRmm:
    """RMM's log held at ``critical`` while the pinned pool asks RMM for a block.

    The pinned pool never grows (its whole size is allocated once), so a request that its
    budget lets through but that finds no free run of that length (a fragmented pool)
    makes RMM's pool try to grow, fail, and log ``[error] ... FAILURE maximum pool size
    exceeded`` on standard error before it raises. The caller falls back to pageable
    memory and counts it (``pinned_refused``): an expected, handled event, which should
    not read as an error in the output of a user's run. RMM's level is process-wide, so
    concurrent callers share one lowering (counted), and anyone else's RMM error logged
    inside that window of microseconds is silenced too.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._depth = 0
        self._level: Any = None

    def __enter__(self) -> None:
        with self._lock:
            if self._depth == 0:
                self._level = rmm.get_logging_level()
                if self._level < rmm.level_enum.critical:
                    rmm.set_logging_level(rmm.level_enum.critical)
            self._depth += 1

    def __exit__(self, *exc: object) -> None:
        with self._lock:
            self._depth -= 1
            if self._depth == 0 and self._level < rmm.level_enum.critical:
                rmm.set_logging_level(self._level)


_QUIET_RMM = _QuietRmm()


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
        self._size = size = align_up(self.limit)
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
            self._stream = streams.items[("rmm", pool_stream(device_id).ptr)][0]

    def charge(self, nbytes: int) -> int:
        # RMM rounds every block up to its alignment: charge that, so that the pool's
        # budget never lets RMM run past its fixed size.
        return align_up(nbytes)

    def _raw(self, nbytes: int) -> tuple[np.ndarray, Callable[[], None] | None]:
        if nbytes == 0:
            return np.empty(0, np.uint8), None
        if self.mr is None:
            raise MemoryError("the pinned pool has size 0")
        try:
            ptr = self._kept[nbytes].pop()  # (list.pop is atomic: no lock needed)
            self._kept_bytes -= align_up(nbytes)
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
                with self._device, _QUIET_RMM:
                    return self.mr.allocate(nbytes, self._stream)
            except Exception as e:
                # Out of pool, or fragmented: once more after giving the kept blocks back,
                # if there were any; else the caller falls back (counted).
                if again or not self._release_kept():
                    raise MemoryError(f"pinned pool could not serve {nbytes} bytes: {e}") from e
        raise AssertionError("not reached")

    def _keep(self, nbytes: int, ptr: int) -> None:
        charged = align_up(nbytes)
        if (
            nbytes > CACHED_BYTES
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
        self._kept_bytes = sum(align_up(n) * len(p) for n, p in list(self._kept.items()))
        return released

    def reserved(self) -> int:
        """Bytes of pinned memory the RMM pool holds (its fixed size)."""
        return 0 if self.mr is None else int(self.mr.pool_size())

    def close(self) -> None:
        if self.mr is not None:
            self._release_kept()


#: device id -> the RMM device resource this process allocates from (see device_pool).
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

    Inside it, CuPy allocations of up to 32 MiB (``CACHED_BYTES``) on a stream of ours
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


SCRATCH = _Scratch()


def _block(nbytes: int, ours: tuple[Any, int]) -> Any:
    """``nbytes`` from the RMM resource, on the stream of ours whose RMM wrapper and
    device are ``ours``, as a CuPy memory pointer."""
    buf = DeviceBuffer(size=nbytes, stream=ours[0])
    mem = cupy.cuda.UnownedMemory(buf.ptr, buf.size, buf, ours[1])
    return cupy.cuda.MemoryPointer(mem, 0)


def _current_ours() -> tuple[Any, int] | None:
    """The RMM wrapper and device of the current stream, when it is one of ours."""
    return streams.items.get(("rmm", cupy.cuda.get_current_stream().ptr))


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


def scratch_cache(device_id: int) -> Any:
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
        if _scope.on and nbytes <= CACHED_BYTES:
            cache = _scratch_caches.items.get(ours[1])
            if cache is not None:
                return cache.malloc(nbytes)
        return _block(nbytes, ours)
    except MemoryError as e:
        if getattr(e, "requested_bytes", None) is None:
            e.requested_bytes = int(nbytes)
        raise


def device_pool(device_id: int, size: int, resource: str) -> Any:
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
            size = align_up(size)
            with cupy.cuda.Device(device_id):
                # overlap.device-memory-resource: "async" is CUDA's stream-ordered pool
                # (cross-stream reuse tracked by the driver), "pool" RMM's own; "auto"
                # is async here (a UCX worker's plugin resolved it to pool already, see
                # dask_overlap.cluster.ucx.device_memory_resource).
                if resource != "pool":
                    pool = rmm.mr.LimitingResourceAdaptor(
                        rmm.mr.CudaAsyncMemoryResource(
                            initial_pool_size=min(size, align_up(2 * 2**30)),
                            release_threshold=size,
                        ),
                        allocation_limit=size,
                    )
                else:
                    pool = rmm.mr.PoolMemoryResource(
                        rmm.mr.CudaMemoryResource(),
                        initial_pool_size=min(size, align_up(2 * 2**30)),
                        maximum_pool_size=size,
                    )
                stats = rmm.mr.StatisticsResourceAdaptor(pool)
                rmm.mr.set_per_device_resource(device_id, stats)
            cupy.cuda.set_allocator(_allocate)
            _device_pools.items[device_id] = stats
        return stats
