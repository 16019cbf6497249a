"""The ``__main__`` kernel trap, and the guard against it (cuda backend).

Dask pickles tasks even for the threaded scheduler. A ``func`` defined in ``__main__`` is
pickled by value, and with it any CuPy kernel it closes over. Unpickled in the same
process, that copy is a second Python object for the same compiled module; when it is
collected, its finalizer unloads a module the original still uses, and the original's
next launch fails with CUDA_ERROR_INVALID_HANDLE (``moduleUnload`` errors follow at exit).
In the same process the copy is pointless: pickle the kernel as a reference to the
original, and give the original back on unpickling.

:func:`guard_kernel_pickling` does so for the whole process (a ``copyreg`` entry):
``dask_overlap.map_blocks`` calls it where CuPy is imported, and so does the cuda backend.
(A pickler of the partition task's own, scoping this to dask_overlap's tasks, was tried:
on the H200 the ``__main__`` kernel trap came back, and a shallow copy of a task went
through pickling; the process-wide entry stays until that is understood.) Where the copy
comes from on the client, found since: Dask's ``tokenize`` of a ``__main__`` function
(``dask.tokenize._normalize_pickle``) pickles it by value and *loads* it again, up to three
times, to check that its pickle is deterministic. ``map_blocks`` tokenizes ``func`` (for
the output's name; ``PartitionTask.__dask_tokenize__`` too), outside any pickler of the
task's own: a scoped guard must cover those calls, a ``copy.copy`` of the task must not go
through the pickler (an explicit ``__copy__``), and an in-process cluster
(``processes=False``) unpickles what the client pickled, so the task's own pickling must
keep the kernels as references too.

Seen on the H200 (CuPy 14.2, Dask 2026.8): ElementwiseKernel fails so; ReductionKernel and
RawKernel closed over the same way work (RawKernel pickles its source and recompiles), so
they keep their own pickling, which also lets them travel to other processes.
"""

from __future__ import annotations

import copyreg
import os
from typing import Any

import cupy

from ..process import Registry

__all__ = ["guard_kernel_pickling"]

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


def guard_kernel_pickling() -> None:
    """Make ``cupy.ElementwiseKernel`` objects pickle as in-process references (idempotent).

    Called by :func:`dask_overlap.map_blocks` when CuPy is imported, before Dask pickles
    the task, and by the cuda backend. See the module's docstring.

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
