"""CuPy arrays between workers over TCP, through pinned memory (#16).

Distributed sends a CuPy array over TCP with its own "dask" serializer
(``distributed.protocol.cupy``): ``cupy.asnumpy`` into fresh pageable memory (a
synchronous D2H that also pays a page fault per page) and, on the other side, an H2D from
the received pageable buffer. Between two workers on an H100, CuPy chunks moved at
1.20 GB/s where NumPy chunks moved at 2.22.

The serializers here keep distributed's layout on the wire: the header is the array's
``__cuda_array_interface__``, copied, plus ``strides``; the one frame is its ``nbytes``
bytes in memory order (C or F; any other layout is copied into a contiguous array first,
as distributed does). Either side may be a process without them. What changes is where
the bytes pass, on a worker whose cuda runtime lends its pinned pool (the
:class:`~dask_overlap.OverlapPlugin` registers it):

- **Sending**: one D2H on a stream of the runtime's pool (non-blocking; ordered after
  the work the calling thread's stream has queued, which made the array), straight into a
  block of the pinned pool, waited for. The frame is a memoryview of that block, and it
  is what holds the block: the block goes back to the pool when distributed has written
  the frame to the socket and dropped it, never before.
- **Receiving**: the runtime's copy threads copy the received bytes into a pinned block
  in parallel, then one H2D on a pooled stream fills device memory allocated in the
  calling thread's stream order (as distributed's own is); the block goes back once that
  copy has completed. A direct H2D from the received buffer would be pageable: the
  driver stages it at about one thread's memcpy (8.1 GB/s on the H200), where several
  threads copy into pinned memory at 32-35 GB/s and a pinned H2D runs at 55 (rates of
  DESIGN.md, each measured alone; this path as a whole is measured by
  ``benchmarks/bench_cross.py``).
- Blocks are lent by :meth:`~dask_overlap.backends.base.HostPool.allocate`, which never
  waits and, with pinned results, holds at most half the pool: transfers never take the
  pipeline's ring. When it has no room, distributed's own pageable path runs, counted.
- The runtime's counters say what happened (``serialized_pinned``,
  ``bytes_serialized_pinned``, ``serialize_fallbacks`` and their ``deserialize`` twins):
  ``runtime_stats()`` shows them.

Only the "dask" family (TCP, spilling to disk) is replaced; the "cuda" family, which UCX
uses to send device buffers as they are, is left alone. Distributed registers its CuPy
serializers lazily, the first time a CuPy type is dispatched; :func:`register` makes that
happen first, so that it cannot replace ours later (once ``distributed.protocol.cupy``
is imported, firing again imports nothing), and keeps distributed's functions as the
fallback. (Distributed's cannot load without numba, which its RMM deserializer imports;
then the fallback is the same pageable path, written out in ``CupyArrays``.)

Importing this module registers the serializers (unless ``overlap.pinned-serialize`` is
false); a process with no lender (a client, say) reaches distributed's path through them.
The array module's side (copies, header) is a small interface, :class:`DeviceArrays`, so
that the tests run the same code on the CPU with a NumPy stand-in and a host runtime.
"""

from __future__ import annotations

import math
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
from distributed.protocol.serialize import dask_deserialize, dask_serialize

from ..config import Options
from ..process import Registry

if TYPE_CHECKING:
    from ..pipeline.runtime import Runtime

__all__ = ["DeviceArrays", "PinnedSerializer", "register", "unregister"]

Header = dict[str, Any]
Dumps = Callable[[Any], tuple[Header, list[Any]]]
Loads = Callable[[Header, Sequence[Any]], Any]


class DeviceArrays(Protocol):
    """The array module's side of the serializers: CuPy's
    (:class:`~dask_overlap.backends.cuda_arrays.CupyArrays`, which owns what it takes of
    the cuda backend's streams), or a NumPy stand-in's in the tests. Pinned memory,
    streams and copy threads are the lending runtime's."""

    #: The array type the serializers are registered for.
    array_type: type

    def device_id(self, x: Any) -> int:
        """The device ``x`` lives on."""

    def current_device(self) -> int:
        """The calling thread's current device (where a received array is made)."""

    def header(self, x: Any) -> Header:
        """Distributed's header of contiguous ``x``: its ``__cuda_array_interface__``,
        copied, with ``strides``."""

    def to_host(self, stream: Any, x: Any, out: np.ndarray) -> Any:
        """Copy ``x``'s bytes in memory order into the ``uint8`` array ``out`` on
        ``stream``, after the work queued on the calling thread's stream, and wait until
        the copy has completed. Returns what was copied: ``x`` when it is C or F
        contiguous, else a contiguous copy of it, made first."""

    def to_device(self, stream: Any, src: np.ndarray, header: Header) -> Any:
        """A new array as ``header`` describes it, its memory allocated in the calling
        thread's stream order and filled from the ``uint8`` array ``src`` on ``stream``;
        waited for."""

    def pageable_dumps(self, x: Any) -> tuple[Header, list[Any]]:
        """Distributed's own serializer, written out (for when it cannot be imported)."""

    def pageable_loads(self, header: Header, frames: Sequence[Any]) -> Any:
        """Distributed's own deserializer, written out."""


# The runtimes lending their pinned pool, streams and copy threads, by (array type,
# device). Weak: a runtime that closes (or goes) stops lending without being told.
_lenders: Registry[tuple[type, int], weakref.ref[Runtime]] = Registry(
    "runtimes lending pinned memory to the serializers, by array type and device"
)
# What register() put in distributed's dispatch tables, by array type. Not a Registry: it
# mirrors those tables, which a forked child keeps as they are.
_installed: dict[type, PinnedSerializer] = {}
_installed_lock = threading.Lock()


class PinnedSerializer:
    """The "dask" serializer pair of one array type: through pinned memory lent by a
    runtime, else the pageable path.

    Parameters
    ----------
    arrays
        The array module's side.
    previous
        The functions registered before (distributed's own), or ``None`` each: the
        pageable path, which :class:`DeviceArrays` then provides.
    """

    def __init__(
        self, arrays: DeviceArrays, previous: tuple[Dumps | None, Loads | None] = (None, None)
    ):
        self.arrays = arrays
        self.previous = previous
        self.fallback_dumps: Dumps = previous[0] or arrays.pageable_dumps
        self.fallback_loads: Loads = previous[1] or arrays.pageable_loads

    def lender(self, device_id: int) -> Runtime | None:
        """The open runtime lending to this array type on ``device_id``, if any."""
        with _lenders.lock:
            ref = _lenders.items.get((self.arrays.array_type, device_id))
        rt = ref() if ref is not None else None
        return None if rt is None or rt.closed else rt

    def dumps(self, x: Any) -> tuple[Header, list[Any]]:
        """Header and one frame of ``x``; see the module docstring."""
        rt = self.lender(self.arrays.device_id(x))
        if rt is None:
            return self.fallback_dumps(x)
        nbytes = int(x.nbytes)
        block = rt.backend.pinned.allocate(nbytes)  # never waits
        if block is None:
            rt.counters.add(serialize_fallbacks=1)
            return self.fallback_dumps(x)
        stream = rt.acquire_stream()
        try:
            src = self.arrays.to_host(stream, x, block)
        finally:
            rt.release_stream(stream)
        rt.counters.add(serialized_pinned=1, bytes_serialized_pinned=nbytes)
        # The frame is the block's one owner from here on (a memoryview keeps the array it
        # views alive): the block goes back to the pool when distributed has sent the frame
        # (or every slice it cut it into) and let go of it.
        return self.arrays.header(src), [memoryview(block)]

    def loads(self, header: Header, frames: Sequence[Any]) -> Any:
        """The array that ``dumps`` (or distributed's own serializer) gave as ``header`` and
        ``frames``; see the module docstring."""
        (frame,) = frames
        src = np.frombuffer(frame, np.uint8)  # the received bytes, not copied
        expected = math.prod(header["shape"]) * np.dtype(header["typestr"]).itemsize
        if src.nbytes != expected:
            raise ValueError(
                f"frame of a {header['typestr']} array of shape {tuple(header['shape'])}: "
                f"expected {expected} bytes, got {src.nbytes}"
            )
        rt = self.lender(self.arrays.current_device())
        if rt is None:
            return self.fallback_loads(header, frames)
        block = rt.backend.pinned.allocate(src.nbytes)  # never waits
        if block is None:
            rt.counters.add(deserialize_fallbacks=1)
            return self.fallback_loads(header, frames)
        rt.copies.run([(src, block)], rt.backend.host_copy)  # in parallel pieces, waited for
        stream = rt.acquire_stream()
        try:
            out = self.arrays.to_device(stream, block, header)
        finally:
            rt.release_stream(stream)
        rt.counters.add(deserialized_pinned=1, bytes_deserialized_pinned=src.nbytes)
        return out  # and the block goes back: the H2D that read it has completed


def _registered(dispatch: Any, array_type: type) -> Any:
    """What ``dispatch`` gives for ``array_type`` now, firing a lazy registration first;
    ``None`` when nothing is registered, or distributed's own could not load."""
    try:
        return dispatch.dispatch(array_type)
    except Exception:  # TypeError: nothing; ImportError: CuPy's without numba, say
        return None


def _ours(fn: Any) -> bool:
    return isinstance(getattr(fn, "__self__", None), PinnedSerializer)


def register(
    runtime: Runtime | None = None, arrays: DeviceArrays | None = None
) -> PinnedSerializer | None:
    """Put the pinned serializers in place of distributed's "dask" ones, and lend
    ``runtime``'s pinned pool, streams and copy threads to them.

    Parameters
    ----------
    runtime
        The runtime that lends, for its device. Without one, the serializers are put in
        place and serve from whatever runtime lends (none: distributed's path).
    arrays
        The array module's side; CuPy's (``backends.cuda_arrays.CupyArrays``) when
        omitted.

    Returns
    -------
    The serializer pair, or ``None`` when CuPy cannot be imported, or the switch
    (``runtime.options.pinned_serialize``; without a runtime, ``overlap.pinned-serialize``)
    is off: then distributed's own serializers are put back, as :func:`unregister` does.

    Examples
    --------
    >>> import dask_overlap
    >>> from dask_overlap.cluster.serialize import register
    >>> register(dask_overlap.get_runtime("cuda"))  # doctest: +SKIP
    <dask_overlap.cluster.serialize.PinnedSerializer object at 0x...>
    """
    if arrays is None:
        try:
            from ..backends.cuda_arrays import CupyArrays

            arrays = CupyArrays()
        except ImportError:
            return None
    on = runtime.options.pinned_serialize if runtime is not None else None
    if on is None:
        on = Options.from_config().pinned_serialize
    if not on:
        unregister(arrays.array_type)
        return None
    t = arrays.array_type
    with _installed_lock:
        ours = _installed.get(t)
        # Distributed's own registration (lazy: on the first dispatch of the type) happens
        # here if it has not yet, so that it cannot replace ours when it would fire later.
        current = (_registered(dask_serialize, t), _registered(dask_deserialize, t))
        if ours is None or current != (ours.dumps, ours.loads):
            # What ours falls back to: what is registered now, or, where that is a pair of
            # ours made before, what that one fell back to (never ours: no loop).
            dumps, loads = (
                fn.__self__.previous[i] if _ours(fn) else fn for i, fn in enumerate(current)
            )
            ours = _installed[t] = PinnedSerializer(arrays, (dumps, loads))
            dask_serialize.register(t, ours.dumps)
            dask_deserialize.register(t, ours.loads)
    if runtime is not None:
        device = runtime.backend.device_id
        with _lenders.lock:
            _lenders.items[(t, device)] = weakref.ref(runtime)
    return ours


def unregister(array_type: type | None = None) -> None:
    """Put back the "dask" serializers that :func:`register` replaced for ``array_type``
    (CuPy's when omitted), and forget its lenders. Nothing to do when none were replaced.

    Examples
    --------
    >>> from dask_overlap.cluster.serialize import unregister
    >>> unregister()  # distributed's own CuPy serializers again
    """
    if array_type is None:
        try:
            import cupy
        except ImportError:
            return
        array_type = cupy.ndarray
    with _lenders.lock:
        for key in [k for k in _lenders.items if k[0] is array_type]:
            del _lenders.items[key]
    with _installed_lock:
        ours = _installed.pop(array_type, None)
        if ours is None:
            return
        pairs = ((dask_serialize, ours.dumps, ours.previous[0]),)
        pairs += ((dask_deserialize, ours.loads, ours.previous[1]),)
        for dispatch, mine, previous in pairs:
            if dispatch._lookup.get(array_type) != mine:
                continue  # somebody registered another since: theirs stays
            if previous is not None:
                dispatch.register(array_type, previous)
            else:
                # dask's Dispatch has no way to remove an entry but its table.
                del dispatch._lookup[array_type]


register()
