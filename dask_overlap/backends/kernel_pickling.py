"""The ``__main__`` kernel trap, and the guard against it (cuda backend).

Dask pickles a ``func`` defined in ``__main__`` by value (when it tokenizes it, and when it
sends a task to a worker), and with it any CuPy kernel it closes over. Unpickled in the same
process, that copy is a second Python object for the same compiled module; when it is
collected, its finalizer unloads a module the original still uses, and the original's
next launch fails with CUDA_ERROR_INVALID_HANDLE (``moduleUnload`` errors follow at exit).
In the same process the copy is pointless: pickle the kernel as a reference to the
original, and give the original back on unpickling.

:func:`kernels_by_reference` does so while it is entered, and dask_overlap enters it
only where it pickles a ``func`` itself or lets Dask do so: while ``map_blocks`` builds the
graph and tokenizes ``func`` (Dask's ``tokenize`` of a ``__main__`` function pickles it by
value and *loads* it again, up to three times, to check that its pickle is deterministic:
that load is the copy), while a partition task is tokenized, and while a partition task is
pickled (:meth:`PartitionTask.__reduce_ex__ <dask_overlap.pipeline.task.PartitionTask>`,
which an in-process cluster unpickles in the same process). Outside those, pickling in the
client is left as it is. (While one thread is inside, the entry is in ``copyreg``'s table
for every thread: a kernel another thread pickles then also travels as a reference.)
:func:`guard_kernel_pickling` installs it for good, for code that pickles such kernels
itself (plain ``dask.array.map_blocks`` with such a kernel).

A first try at scoping (a pickler of the partition task's own, 2827634) failed on the H200:
``map_blocks``'s ``tokenize`` of ``func`` was outside it (the trap came back), and a
``copy.copy`` of a task went through that pickler (the task now has its own ``__copy__``).

Seen on the H200 (CuPy 14.2, Dask 2026.8): ElementwiseKernel fails so; ReductionKernel and
RawKernel closed over the same way work (RawKernel pickles its source and recompiles), so
they keep their own pickling, which also lets them travel to other processes.

The copy that breaks is the compiled module's: ``cupy.cuda.function.Module`` is a Cython
class that pickles by value (its handle, as a number), and whose finalizer unloads that
handle. Any CuPy object that keeps compiled kernels in a memo copies them so, and so does
a CuPy ufunc (``cupy.negative``, ``cupy.sqrt``: the commonest ``func`` of all) once it has
run in the process: ``dask_overlap.map_blocks(cupy.negative, x)``, in a test process
where it had, crashed the process in Dask's ``tokenize`` on an H100 (CuPy 14.2, Dask 2026.11),
inside ``pickle.loads`` of the ufunc: read from CuPy's source, each copy that dies unloads
the module the original uses, and the next one unloads it again. So, while entered:

- a CuPy ufunc that CuPy publishes (``cupy.negative``) pickles by its name, which finds the
  same object in this process and CuPy's own in any other;
- ``cupy.ElementwiseKernel``, any other ufunc and any ``Module`` pickle as references to
  the original, which resolve in this process only (elsewhere, a clear error).
"""

from __future__ import annotations

import contextlib
import copyreg
import functools
import importlib
import os
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

import cupy

from ..process import Registry

__all__ = ["guard_kernel_pickling", "kernels_by_reference"]

#: id(kernel) -> the kernel, for the references pickled in this process.
_kernels: Registry[int, Any] = Registry("cuda kernels pickled by reference")
#: The namespaces whose ufuncs pickle by name (those imported are searched).
_PUBLIC = ("cupy", "cupyx.scipy.special")
_guarded = False


def _kernel_by_reference(pid: int, key: int) -> Any:
    kernel = _kernels.items.get(key) if pid == os.getpid() else None
    if kernel is None:
        raise RuntimeError(
            "a CuPy kernel (a cupy.ElementwiseKernel, a ufunc of your own or a compiled "
            "module) that func closes over was sent to another process, where it cannot "
            "be used: create the kernel inside func, or define it in an importable module "
            "(not __main__) so that each process builds its own"
        )
    return kernel


def _reduce_kernel(kernel: Any) -> tuple[Any, tuple[int, int]]:
    with _kernels.lock:
        # Held for the life of the process: a module-level kernel lives that long anyway,
        # and the reference must resolve whenever the task is unpickled.
        _kernels.items[id(kernel)] = kernel
    return _kernel_by_reference, (os.getpid(), id(kernel))


def _public_ufunc(module: str, name: str) -> Any:
    return getattr(importlib.import_module(module), name)


def _public_name(ufunc: Any) -> tuple[str, str] | None:
    """Where CuPy publishes ``ufunc`` (``("cupy", "negative")``), or None."""
    name = str(getattr(ufunc, "__name__", ""))
    for module in _PUBLIC:
        namespace = sys.modules.get(module)
        if namespace is None:
            continue
        # CuPy names a ufunc after its place: cupy_negative is cupy.negative.
        guess = name.removeprefix(module.replace(".", "_") + "_")
        for attr in (guess, *list(vars(namespace))):
            if getattr(namespace, attr, None) is ufunc:
                return module, attr
    return None


def _reduce_ufunc(ufunc: Any) -> tuple[Any, tuple[Any, ...]]:
    where = _public_name(ufunc)
    if where is None:
        return _reduce_kernel(ufunc)
    return _public_ufunc, where


@functools.cache
def _by_reference() -> dict[type, Callable[[Any], tuple[Any, tuple[Any, ...]]]]:
    """The ``copyreg`` entries, by type (those this CuPy has)."""
    table: dict[type, Callable[[Any], tuple[Any, tuple[Any, ...]]]] = {
        cupy.ElementwiseKernel: _reduce_kernel
    }
    ufunc = getattr(cupy, "ufunc", None)
    if isinstance(ufunc, type):
        table[ufunc] = _reduce_ufunc
    try:
        from cupy.cuda.function import Module
    except ImportError:  # (a stand-in cupy, in the tests of the guard's scope)
        pass
    else:
        table[Module] = _reduce_kernel
    return table


_scope = threading.Lock()
_entered = 0  # threads inside kernels_by_reference
_before: dict[type, Any] = {}  # the copyreg entries before the first thread entered


@contextlib.contextmanager
def kernels_by_reference() -> Iterator[None]:
    """While entered, CuPy's kernels pickle as in-process references and its ufuncs by name
    (re-entrant, thread-safe; see the module's docstring). The ``copyreg`` table is as it
    was once no thread is inside.

    Examples
    --------
    >>> import copyreg, pickle, cupy
    >>> k = cupy.ElementwiseKernel("T x", "T y", "y = x", "copy_s")
    >>> with kernels_by_reference():
    ...     pickle.loads(pickle.dumps(k)) is k, pickle.loads(pickle.dumps(cupy.sqrt)) is cupy.sqrt
    (True, True)
    >>> from dask_overlap.backends import kernel_pickling  # (its state now, not at import)
    >>> kernel_pickling._guarded or cupy.ElementwiseKernel not in copyreg.dispatch_table
    True
    """
    global _entered, _before
    with _scope:
        if _entered == 0 and not _guarded:
            table = _by_reference()
            _before = {t: copyreg.dispatch_table.get(t) for t in table}
            copyreg.dispatch_table.update(table)
        _entered += 1
    try:
        yield
    finally:
        with _scope:
            _entered -= 1
            if _entered == 0 and not _guarded:
                for t, before in _before.items():
                    if before is None:
                        copyreg.dispatch_table.pop(t, None)
                    else:
                        copyreg.dispatch_table[t] = before
                _before = {}


def guard_kernel_pickling() -> None:
    """Make CuPy's kernels pickle as in-process references and its ufuncs by name, for good
    (idempotent).

    For code that pickles such kernels itself (plain ``dask.array.map_blocks``): it changes
    pickling for the whole process (dask_overlap itself only enters
    :func:`kernels_by_reference`). See the module's docstring.

    Examples
    --------
    >>> import pickle, cupy
    >>> guard_kernel_pickling()
    >>> k = cupy.ElementwiseKernel("T x", "T y", "y = x", "copy_k")
    >>> pickle.loads(pickle.dumps(k)) is k
    True
    """
    global _guarded
    with _scope:
        for t, reduce in _by_reference().items():
            copyreg.pickle(t, reduce)
        _guarded = True
