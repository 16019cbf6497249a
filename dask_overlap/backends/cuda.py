"""The ``cuda`` backend: CuPy streams, an RMM pinned host pool and an RMM device pool.

Its concerns live in modules of their own: the streams and their completion waiters
(:mod:`.cuda_streams`), the pinned pool, the device pool and its scratch cache
(:mod:`.cuda_memory`), the serializers' view of CuPy arrays (:mod:`.cuda_arrays`), and,
here, :class:`CudaBackend`: the copies between host and device on a stream, ``func`` on
a stream, and the marks that time them. The orderings it relies on: every copy is
enqueued on the sub-chunk's in-order stream, so the kernel reads a finished copy-in and
the copy-out a finished result; a host buffer an asynchronous copy reads is held by the
runner until an event recorded after the copy has completed (RMM's stream-ordered pools
protect GPU work, never the host).

Nothing here touches CUDA at import time; everything is created by :class:`CudaBackend`.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
import time
import weakref
from collections.abc import Callable
from typing import Any

import cupy
import numpy as np
import rmm.mr

from ..config import Options
from .base import requested_bytes
from .cuda_memory import SCRATCH, PinnedPool, device_pool, scratch_cache
from .cuda_streams import CudaStream
from .cuda_trace import EventTrace

logger = logging.getLogger(__name__)

__all__ = ["CudaBackend", "CudaStream", "PinnedPool"]


_H2D = 1  # cudaMemcpyHostToDevice

_D2H = 2  # cudaMemcpyDeviceToHost

#: Timing events kept for reuse once resolved (four per sub-chunk in flight).
_SPARE_MARKS = 1024

#: Arrays whose pinnedness is remembered (see CudaBackend.is_pinned).
_PINNED_ROOTS = 4096


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
        self._device_mr = device_pool(
            self.device_id, options.device_pool_size, options.device_memory_resource
        )
        self._scratch = scratch_cache(self.device_id)
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

    def scratch(self) -> contextlib.AbstractContextManager[None]:
        return SCRATCH

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

    def host_copy(self, src: np.ndarray, dst: np.ndarray) -> None:
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

    def fetch(self, stream: CudaStream, device: Any) -> np.ndarray:
        # Called in the stream's order (current): get() waits for the stream's work
        # before it, the reduction that made ``device`` included.
        return device.get(stream=stream.cupy)

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
