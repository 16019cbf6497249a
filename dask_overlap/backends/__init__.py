"""Backends behind one interface (:class:`~dask_overlap.backends.base.Backend`).

``cuda`` (CuPy + RMM) is imported only when asked for, so this package imports on
machines with no GPU and no CuPy.
"""

from __future__ import annotations

import contextlib
import functools
import sys
from typing import Any

from dask.base import tokenize

from ..config import BACKENDS, Options
from .base import Backend, HostPool, Stream

__all__ = [
    "Backend",
    "HostPool",
    "Stream",
    "gpu_available",
    "kernels_kept",
    "make_backend",
    "tokenize_kept",
    "resolve_backend",
]


def kernels_kept() -> contextlib.AbstractContextManager:
    """While entered, CuPy kernels pickle as references to themselves in this process (see
    :mod:`~dask_overlap.backends.kernel_pickling`): where CuPy is imported, since only then
    can a kernel exist; CPU-only use never imports it."""
    if "cupy" not in sys.modules:
        return contextlib.nullcontext()
    from .kernel_pickling import kernels_by_reference

    return kernels_by_reference()


def tokenize_kept(*args: Any) -> str:
    """Dask's ``tokenize`` of ``args`` inside :func:`kernels_kept`: for the ``__dask_tokenize__``
    of anything that holds a user's ``func`` (``tokenize`` pickles it and loads the copy)."""
    with kernels_kept():
        return tokenize(*args)


@functools.cache
def gpu_available() -> bool:
    """Whether CuPy is installed and sees a CUDA device (never raises).

    Asked once per process: the answer cannot change (``CUDA_VISIBLE_DEVICES`` is read
    when CUDA starts), and every partition task resolves ``auto`` through it.
    """
    try:
        import cupy
    except Exception:
        return False
    try:
        return bool(cupy.cuda.is_available())
    except Exception:
        return False


def resolve_backend(name: str) -> str:
    """The concrete backend ``name`` stands for (``auto`` becomes ``cuda`` or ``host``)."""
    if name not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}; got {name!r}")
    if name == "auto":
        return "cuda" if gpu_available() else "host"
    return name


def make_backend(options: Options) -> Backend:
    """Build the backend that ``options.backend`` names (resolving ``auto``)."""
    name = resolve_backend(options.backend)
    if name == "host":
        from .host import HostBackend

        return HostBackend(options.pinned_pool_size)
    if name == "timed":
        from .timed import TimedBackend

        return TimedBackend(options.pinned_pool_size, options.timed)
    try:
        from .cuda import CudaBackend
    except ImportError as e:
        raise ImportError(
            "the cuda backend needs CuPy and RMM: pip install 'dask_overlap[cuda13]' "
            f"(or [cuda12]); importing them failed with: {e}"
        ) from e
    if not gpu_available():
        raise RuntimeError("backend 'cuda' was asked for, but no CUDA device is visible")
    return CudaBackend(options)
