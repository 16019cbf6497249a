"""The ``__main__`` kernel trap, and the guard against it (cuda backend).

Dask pickles tasks even for the threaded scheduler. A ``func`` defined in ``__main__`` is
pickled by value, and with it any CuPy kernel it closes over. Unpickled in the same
process, that copy is a second Python object for the same compiled module; when it is
collected, its finalizer unloads a module the original still uses, and the original's
next launch fails with CUDA_ERROR_INVALID_HANDLE (``moduleUnload`` errors follow at exit).
In the same process the copy is pointless: pickle the kernel as a reference to the
original, and give the original back on unpickling.

dask_overlap does so for its own partition tasks only (:func:`dumps`, which the task's
``__reduce_ex__`` uses where CuPy is imported): how the rest of a client pickles is left
as it is. :func:`guard_kernel_pickling` offers the same to code that pickles kernels
itself (plain ``dask.array.map_blocks`` with such a kernel), changing pickling for the
whole process; nothing here calls it.

Seen on the H200 (CuPy 14.2, Dask 2026.8): ElementwiseKernel fails so; ReductionKernel and
RawKernel closed over the same way work (RawKernel pickles its source and recompiles), so
they keep their own pickling, which also lets them travel to other processes.
"""

from __future__ import annotations

import copyreg
import io
import os
from typing import Any

import cloudpickle
import cupy

from ..process import Registry

__all__ = ["dumps", "guard_kernel_pickling"]

#: id(kernel) -> the kernel, for the references pickled in this process.
_kernels: Registry[int, Any] = Registry("cuda kernels pickled by reference")
_guarded = False


def _kernel_by_reference(pid: int, key: int) -> Any:
    kernel = _kernels.items.get(key) if pid == os.getpid() else None
    if kernel is None:
        raise RuntimeError(
            "a cupy.ElementwiseKernel that func closes over was sent to another process, "
            "where it cannot be used: create the kernel inside func, or define it in an "
            "importable module (not __main__) so that each process builds its own"
        )
    return kernel


def _reduce_kernel(kernel: Any) -> tuple[Any, tuple[int, int]]:
    with _kernels.lock:
        # Held for the life of the process: a module-level kernel lives that long anyway,
        # and the reference must resolve whenever the task is unpickled.
        _kernels.items[id(kernel)] = kernel
    return _kernel_by_reference, (os.getpid(), id(kernel))


class _Pickler(cloudpickle.Pickler):
    """cloudpickle, with ``cupy.ElementwiseKernel`` objects as in-process references."""

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, cupy.ElementwiseKernel):
            return _reduce_kernel(obj)
        return super().reducer_override(obj)


def dumps(obj: Any) -> bytes:
    """``obj`` pickled (by cloudpickle, so a ``__main__`` function by value), with every
    ``cupy.ElementwiseKernel`` in it as a reference to the kernel in this process.

    Examples
    --------
    >>> import pickle, cupy
    >>> k = cupy.ElementwiseKernel("T x", "T y", "y = x", "copy_d")
    >>> pickle.loads(dumps({"k": k}))["k"] is k
    True
    """
    buf = io.BytesIO()
    _Pickler(buf).dump(obj)
    return buf.getvalue()


def guard_kernel_pickling() -> None:
    """Make ``cupy.ElementwiseKernel`` objects pickle as in-process references (idempotent).

    For code that pickles such kernels itself; it changes pickling for the whole process.
    dask_overlap's own tasks need none of it (see :func:`dumps`).

    Examples
    --------
    >>> import pickle, cupy
    >>> guard_kernel_pickling()
    >>> k = cupy.ElementwiseKernel("T x", "T y", "y = x", "copy_k")
    >>> pickle.loads(pickle.dumps(k)) is k
    True
    """
    global _guarded
    if _guarded:
        return
    copyreg.pickle(cupy.ElementwiseKernel, _reduce_kernel)
    _guarded = True
