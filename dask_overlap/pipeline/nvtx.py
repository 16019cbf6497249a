"""NVTX ranges named after the Dask key and sub-chunk, so an Nsight timeline lines up with
Dask's task stream (cuda backend, under a profiler only)."""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable, Iterator
from typing import Any

from .stages import argb

__all__ = ["PROFILER_VARIABLES", "nvtx_range"]

#: Set in a process that Nsight Systems or Nsight Compute runs (their injection libraries).
PROFILER_VARIABLES = ("NVTX_INJECTION64_PATH", "CUDA_INJECTION64_PATH")


@functools.cache
def _nvtx() -> tuple[Callable[[str, int], Any], Callable[[], Any]] | None:
    """Push and pop functions of ``nvtx`` or ``cupy.cuda.nvtx``; ``None`` if neither works."""
    try:
        import nvtx  # type: ignore[import-not-found]

        def push(message: str, color: int) -> None:
            nvtx.push_range(message, color=color & 0xFFFFFF, domain="dask_overlap")

        return push, functools.partial(nvtx.pop_range, domain="dask_overlap")
    except Exception:
        pass
    try:
        from cupy.cuda import nvtx as cupy_nvtx  # type: ignore[import-not-found]

        if not getattr(cupy_nvtx, "available", True):
            return None

        def cupy_push(message: str, color: int) -> None:
            # CuPy 14's RangePush takes no colour keyword (seen on the H200): RangePushC
            # takes an ARGB colour; plain RangePush is the fallback.
            try:
                cupy_nvtx.RangePushC(message, color)
            except (AttributeError, TypeError):
                cupy_nvtx.RangePush(message)

        return cupy_push, cupy_nvtx.RangePop
    except Exception:
        return None


@functools.cache
def _profiled() -> bool:
    """Whether a profiler is attached: without one an NVTX range does nothing, but its
    name would still be formatted, per partition and per sub-chunk."""
    return any(os.environ.get(v) for v in PROFILER_VARIABLES)


def nvtx_range(
    backend: str, key: Any, sub_chunk: int | None = None, stage: str | None = None
) -> contextlib.AbstractContextManager[None]:
    """An NVTX range named after the Dask ``key`` (and ``sub_chunk`` and ``stage``).

    Only on the ``cuda`` backend, only under a profiler (:data:`PROFILER_VARIABLES`), and
    only where ``nvtx`` or ``cupy.cuda.nvtx`` imports; a no-op otherwise. The range is
    pushed and popped on the calling thread, around the host calls that enqueue the work,
    so Nsight projects it onto the stream's GPU work.

    Examples
    --------
    >>> with nvtx_range("host", ("x", 0), 3, "h2d"):  # no-op off the cuda backend
    ...     pass
    """
    if backend != "cuda" or not _profiled() or _nvtx() is None:
        return _NO_RANGE  # as cheap as a context manager gets: called per sub-chunk
    return _range(key, sub_chunk, stage)


_NO_RANGE = contextlib.nullcontext()


@contextlib.contextmanager
def _range(key: Any, sub_chunk: int | None, stage: str | None) -> Iterator[None]:
    push, pop = _nvtx()  # type: ignore[misc]  # checked by nvtx_range
    name = str(key) if sub_chunk is None else f"{key} #{sub_chunk} {stage}"
    push(name, argb(stage))
    try:
        yield
    finally:
        pop()
