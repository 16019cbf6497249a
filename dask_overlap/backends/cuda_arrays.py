"""The cuda backend's side of the serializers of CuPy arrays
(:mod:`dask_overlap.cluster.serialize`).

What it does on the backend's streams (a copy enqueued on one, after the work the caller's
stream has queued, and waited for) belongs to the backend, so it lives here, beside the
streams it uses, and the serializers see only the small ``DeviceArrays`` interface.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = ["CupyArrays"]

Header = dict[str, Any]

_H2D = 1  # cudaMemcpyHostToDevice
_D2H = 2  # cudaMemcpyDeviceToHost


class CupyArrays:
    """:class:`DeviceArrays` for CuPy, on a cuda runtime's
    :class:`~dask_overlap.backends.cuda.CudaStream`.

    Examples
    --------
    >>> CupyArrays().array_type  # doctest: +SKIP
    <class 'cupy.ndarray'>
    """

    def __init__(self) -> None:
        import cupy  # here, not at import: importing this module must not need CuPy

        self.cupy = cupy
        self.array_type: type = cupy.ndarray

    def device_id(self, x: Any) -> int:
        return int(x.device.id)

    def current_device(self) -> int:
        return int(self.cupy.cuda.runtime.getDevice())

    def header(self, x: Any) -> Header:
        # Read on the calling thread, outside our stream: the interface's "stream" entry
        # is then the one distributed's own header would carry.
        header = x.__cuda_array_interface__.copy()
        header["strides"] = tuple(x.strides)
        return header

    def _after(self, stream: Any, caller: Any) -> None:
        """``stream`` (current, in :meth:`CudaStream.run`) waits for ``caller``'s work."""
        if not caller.done:  # one query costs less than an event recorded and waited for
            stream.cupy.wait_event(caller.record())

    def to_host(self, stream: Any, x: Any, out: np.ndarray) -> Any:
        cupy = self.cupy
        # The array was made in this thread's stream order (the legacy default stream for
        # plain CuPy code), which our non-blocking stream does not wait for by itself.
        caller = cupy.cuda.get_current_stream()

        def enqueue() -> Any:
            self._after(stream, caller)
            src = x
            if not (x.flags["C_CONTIGUOUS"] or x.flags["F_CONTIGUOUS"]):
                src = cupy.array(x, copy=True)  # as distributed does: the same layout
            if src.nbytes:
                cupy.cuda.runtime.memcpyAsync(
                    out.ctypes.data, src.data.ptr, src.nbytes, _D2H, stream.ptr
                )
            return src

        # ``run`` waits for the copy (a blocking event, no spinning CPU): the frame is
        # complete before distributed sees it, and ``out`` may then be sent from.
        return stream.run(enqueue)

    def to_device(self, stream: Any, src: np.ndarray, header: Header) -> Any:
        cupy = self.cupy
        caller = cupy.cuda.get_current_stream()
        # Allocated in the caller's stream order, as distributed's own deserializer does:
        # whoever uses (and frees) the array on that stream next needs nothing more, and
        # our stream waits for the allocation before it copies into it.
        buf = cupy.empty(src.nbytes, cupy.uint8)

        def enqueue() -> None:
            self._after(stream, caller)
            if src.nbytes:
                cupy.cuda.runtime.memcpyAsync(
                    buf.data.ptr, src.ctypes.data, src.nbytes, _H2D, stream.ptr
                )

        stream.run(enqueue)  # waited for: ``src`` may go back to the pool afterwards
        return self._view(buf, header)

    def _view(self, buf: Any, header: Header) -> Any:
        """The ``uint8`` device array ``buf``'s memory as the array ``header`` describes."""
        shape, dtype, strides = header["shape"], header["typestr"], header["strides"]
        return self.cupy.ndarray(shape=shape, dtype=dtype, memptr=buf.data, strides=strides)

    def pageable_dumps(self, x: Any) -> tuple[Header, list[Any]]:
        # distributed.protocol.cupy.dask_serialize_cupy_ndarray, step for step.
        cupy = self.cupy
        if not (x.flags["C_CONTIGUOUS"] or x.flags["F_CONTIGUOUS"]):
            x = cupy.array(x, copy=True)
        header = self.header(x)
        flat = cupy.ndarray(shape=(x.nbytes,), dtype=cupy.dtype("u1"), memptr=x.data, strides=(1,))
        return header, [memoryview(cupy.asnumpy(flat))]

    def pageable_loads(self, header: Header, frames: Sequence[Any]) -> Any:
        # distributed.protocol.cupy.dask_deserialize_cupy_ndarray: one H2D from the frame
        # on the current stream, synchronous.
        (frame,) = frames
        return self._view(self.cupy.asarray(np.frombuffer(frame, np.uint8)), header)
