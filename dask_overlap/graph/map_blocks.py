"""``dask_overlap.map_blocks``: the call users make, thin on purpose.

It validates (:mod:`.checks`), then hands the graph to ``dask.array.map_blocks`` itself,
with the user's function wrapped in a partition task
(:class:`~dask_overlap.pipeline.task.PartitionTask`), so chunk alignment, broadcasting,
constants, delayed arguments, ``drop_axis``/``new_axis``, ``name``/``token`` and
``block_info``/``block_id`` behave exactly as Dask's do. Small blocks are joined into
batches (:mod:`.batch`), and the layer Dask built is rewritten once
(:func:`.rewrite.partition_layer`).

Dask's function is the one this module imported, not whatever ``dask.array.map_blocks``
names when called, so that ``dask.array.map_blocks`` (and ``Array.map_blocks``) may be
routed here (tests/test_dask_map_blocks.py runs Dask's own tests so) without a loop.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import dask.array as da
import dask.config
import numpy as np
from dask.array.core import map_blocks as dask_map_blocks
from dask.array.utils import compute_meta
from dask.base import is_dask_collection
from dask.utils import funcname, has_keyword

from ..backends import kernels_kept, resolve_backend
from ..config import Options
from ..config import defaults as config_defaults  # (the package's own, from its YAML)
from ..pipeline.task import PartitionTask, PartitionTaskWithInfo
from .batch import auto_batch, joined, split_arrays, unbatched, worker_budget
from .checks import (
    array_positions,
    check_axes,
    check_batch,
    check_dtype,
    check_func,
    check_inputs,
    check_numblocks,
    check_out_mode,
    check_output_axes,
    check_split_axis,
)
from .fusion import install as install_fusion
from .infer import infer_dtype, refuse_meta
from .placement import placement
from .rewrite import partition_layer

__all__ = ["map_blocks"]


def _out_axis(ndim: int, axis: int, drop_axis: list[int], new_axis: list[int], chunks: Any) -> int:
    """Where input-space ``axis`` lands in the output, following Dask's own bookkeeping."""
    labels: list[int] = list(range(ndim))[::-1]
    dropped = {d % ndim for d in drop_axis} if ndim else set()
    labels = [x for i, x in enumerate(labels) if i not in dropped]
    if not new_axis and chunks is not None and len(labels) < len(chunks):
        new_axis = list(range(len(chunks) - len(labels)))
    for j, ax in enumerate(sorted(new_axis)):
        labels.insert(ax, -1 - j)
    return labels.index(ndim - 1 - axis)


def _inferred_dtype_and_meta(
    func: Callable[..., Any], arrays: Sequence[Any], kwargs: dict, dtype: Any, backend: str
) -> tuple[Any, Any]:
    """What Dask would infer for a ``meta=None`` call, without running a pipeline; ``meta``
    is ``None`` (or not an array) where ``func`` fails on empty blocks."""
    # Dask would compute meta by calling the task itself, which would run a pipeline at
    # graph construction; call the user's function on empty NumPy blocks instead, as
    # dask.array.map_blocks does with its own function.
    try:
        meta = compute_meta(func, dtype, *arrays, **kwargs)
    except Exception:
        meta = None
    refuse_meta(meta, f"{funcname(func)}'s output on empty NumPy blocks (Dask's meta)")
    if dtype is None:
        given = (*arrays, *kwargs.values())  # (a keyword may be a delayed object too)
        if any(is_dask_collection(a) and not isinstance(a, da.Array) for a in given):
            # Dask infers ``object`` here (func runs on the delayed object itself),
            # which no device array can hold: ask for the dtype instead.
            raise TypeError(
                "dtype must be given when an argument is a dask.delayed object (the "
                "output dtype cannot be inferred without computing it); got dtype=None"
            )
        on_gpu = resolve_backend(backend) == "cuda"
        dtype = infer_dtype(func, arrays, kwargs, on_gpu)
    return dtype, meta


def _dtype_and_meta(
    func: Callable[..., Any],
    arrays: Sequence[Any],
    kwargs: dict,
    *,
    dtype: Any,
    meta: Any,
    chunks: Any,
    kept_ndim: int,
    backend: str,
    out_mode: str,
) -> tuple[Any, Any]:
    """The ``dtype`` and ``meta`` to give Dask: inferred where not given, checked, and a
    CuPy ``meta`` where the blocks stay on the GPU. ``kept_ndim``: the output's dimensions
    after ``drop_axis`` and ``new_axis``, where ``chunks`` does not say."""
    if meta is None:
        dtype, meta = _inferred_dtype_and_meta(func, arrays, kwargs, dtype, backend)
        if not isinstance(meta, np.ndarray):
            out_ndim = len(chunks) if chunks is not None else kept_ndim
            meta = np.empty((0,) * out_ndim, dtype=dtype)
    if dtype is not None:
        check_dtype("the output of func (dtype)", dtype)
    if out_mode == "device" and isinstance(meta, np.ndarray) and resolve_backend(backend) == "cuda":
        import cupy

        meta = cupy.empty(meta.shape, meta.dtype)  # the chunks are CuPy arrays
    return dtype, meta


def _of_the_call(name: str, given: Any, opts: Options) -> Any:
    """A call's ``sub_chunk_bytes`` or ``in_flight``: the keyword given, else this
    process's ``overlap.*`` where it is set to other than its default, else ``None``: the
    runtime that runs the partition decides (a worker's plugin's options, as
    ``LocalGPUCluster(in_flight=2)`` or ``register(client, in_flight=2)`` gave them; in
    this process, its ``overlap.*`` as the task runs)."""
    key = name.replace("_", "-")
    if given is None and dask.config.get(f"overlap.{key}") == config_defaults["overlap"][key]:
        return None
    return getattr(opts, name)


def _partition_task(
    func: Callable[..., Any],
    opts: Options,
    positions: tuple[int, ...],
    ndim: int,
    split_axis: int | None,
    out_split_axis: int | None,
    out_mode: str,
    batch: int,
    enforce_ndim: bool,
    sub_chunk_bytes: Any,
    in_flight: Any,
) -> PartitionTask:
    """The task Dask maps over the blocks, asking for ``block_info`` only if ``func`` does;
    ``sub_chunk_bytes`` and ``in_flight``: the call's keywords (``None``: not given)."""
    task_type = PartitionTaskWithInfo if has_keyword(func, "block_info") else PartitionTask
    return task_type(
        func,
        backend=opts.backend,
        array_positions=positions,
        ndim=ndim,
        split_axis=split_axis,
        out_split_axis=out_split_axis,
        sub_chunk_bytes=_of_the_call("sub_chunk_bytes", sub_chunk_bytes, opts),
        in_flight=_of_the_call("in_flight", in_flight, opts),
        func_block_id=has_keyword(func, "block_id"),
        func_block_info=has_keyword(func, "block_info"),
        out_mode=out_mode,
        batch=batch,
        enforce_ndim=enforce_ndim,
    )


def _auto_batch(
    func: Callable[..., Any],
    arrays: Sequence[Any],
    positions: tuple[int, ...],
    ndim: int,
    split_axis: int | None,
    chunks: Any,
    drop_axis: Any,
    backend: str,
) -> int:
    """``batch="auto"`` for this call: :func:`.batch.auto_batch`, kept within what the
    workers' memory allows (:func:`.batch.worker_budget`), and 1 where every partition
    will run on the host backend (:mod:`.placement`: joining blocks only pays for a
    device). Where the partitions will run is asked only where blocks would be joined."""
    asks = has_keyword(func, "block_id") or has_keyword(func, "block_info")
    batch = auto_batch(asks, arrays, positions, ndim, split_axis, chunks, drop_axis)
    if batch > 1:
        where = placement(backend)
        if where.on_host:
            return 1
        budget = worker_budget(where.workers) if where.workers is not None else None
        if budget is not None:
            batch = auto_batch(asks, arrays, positions, ndim, split_axis, chunks, drop_axis, budget)
    return batch


def _keeping_kernels(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` run with CuPy kernels pickled as references to themselves: Dask's ``tokenize``
    of ``func`` pickles it and loads the copy (see
    :mod:`dask_overlap.backends.kernel_pickling`)."""

    @functools.wraps(fn)
    def keeping(*args: Any, **kwargs: Any) -> Any:
        with kernels_kept():
            return fn(*args, **kwargs)

    return keeping


@_keeping_kernels
def map_blocks(
    func: Callable[..., Any],
    *arrays: Any,
    dtype: Any = None,
    chunks: Any = None,
    drop_axis: int | Sequence[int] | None = None,
    new_axis: int | Sequence[int] | None = None,
    enforce_ndim: bool = False,
    split_axis: int | None = None,
    sub_chunk_bytes: int | str | None = None,
    in_flight: int | None = None,
    out: str = "host",
    batch: int | str = "auto",
    meta: Any = None,
    name: str | None = None,
    token: str | None = None,
    **kwargs: Any,
) -> da.Array:
    """Map ``func`` over the blocks of dask arrays, each partition as an assembly line.

    The same call as :func:`dask.array.map_blocks`, with the same result; inside each
    partition task ``func`` receives the backend's arrays (CuPy on the GPU, NumPy on the
    host path) and returns one. Each partition is copied to the device, computed and
    copied back through the worker's stream and pinned-memory pools, overlapped with
    the other partitions the worker runs.

    Parameters
    ----------
    func
        Called on the blocks of ``arrays`` (and on the other arguments as they are).
    *arrays
        Dask arrays, aligned and broadcast as Dask does; other objects (constants,
        delayed objects) are passed through.
    dtype, chunks, drop_axis, new_axis, meta, name, token, **kwargs
        As in :func:`dask.array.map_blocks`. When ``dtype`` is not given it is inferred
        as Dask does, on tiny NumPy blocks, and where the backend is ``cuda`` in this
        process, on CuPy blocks if NumPy ones fail.
    enforce_ndim
        Accepted with Dask's meaning, and always in force: every output block's shape
        and dtype are checked against what the array declares, before they are copied.
        As with Dask, ``True`` and ``False`` give arrays of different names.
    split_axis
        Declares that ``func`` is independent along this axis: each partition is then
        cut along it into sub-chunks of about ``sub_chunk_bytes`` that are pipelined
        (the next copies in while one computes and the one before copies out). The
        output's extent along it must equal the input's. ``None`` (default): each
        partition is one sub-chunk.
    sub_chunk_bytes
        Target sub-chunk size, an int or a string such as ``"32MiB"``, or ``"auto"``
        (default ``overlap.sub-chunk-bytes``, ``auto``: cut a partition only as far as
        the partitions running beside it leave the device short of work; on the host
        backend, which has no device, not at all). A size given cuts on every backend.
    in_flight
        How many sub-chunks of a partition may be in flight at once (the bounded queue;
        default ``overlap.in-flight``). When it is full the submitter waits. This and
        ``sub_chunk_bytes``, left out and not set in this process's configuration, are
        the worker's (``LocalGPUCluster(in_flight=2)``, ``register(client, ...)``).
    out
        ``"host"`` (default): each output block is an ordinary NumPy array, copied back
        through the worker's pinned ring. ``"pinned"``: a NumPy array in the worker's
        pinned pool, written by the copy from the device with no further copy (for a
        consumer that copies it to a device again); Dask holds it, so at most half the
        pool is kept so, and past that blocks are ordinary arrays (``pinned_fallbacks``).
        ``"device"``: it stays where ``func`` computed it, a CuPy array on the GPU
        (NumPy on the host path), and nothing is copied back; ``meta`` is then a CuPy
        array when the backend resolves to ``cuda`` in the calling process.
    batch
        Blocks per partition along ``split_axis``. With ``batch=k`` each partition task
        gets ``k`` consecutive blocks and joins them (pageable blocks into one block of
        the pinned pool, which is the staging copy they would have had anyway; pinned
        blocks straight into one device array, a copy each; device blocks on the
        device), so small chunks pay one task's and one partition's overhead per ``k``.
        The output then has one block per ``k`` input blocks along ``split_axis``, and
        ``block_info``/``block_id`` describe those blocks. Needs ``split_axis``; not with
        ``chunks`` or ``drop_axis``. ``"auto"`` (default): joins blocks smaller than
        64 MiB into partitions of about 64 MiB where that is sound (``split_axis`` given,
        neither ``chunks`` nor ``drop_axis``, a ``func`` that takes neither ``block_id``
        nor ``block_info``, block sizes known) and cuts each partition's output back
        into its blocks (views), so the output's chunks are the blocks' as with
        ``batch=1``; elsewhere it is 1, and so it is where every partition will run on
        the host backend (no device: a join would only copy; see
        :mod:`dask_overlap.graph.placement` for how the client tells). A next auto stage
        that joins the same blocks takes those partitions' outputs as they are (the cut
        is then never run).
        ``split_axis`` already lets ``func`` see any slice along the axis: sub-chunks
        cut a partition, batches join several.

    Returns
    -------
    dask.array.Array

    Examples
    --------
    >>> import dask.array as da, dask_overlap
    >>> x = da.arange(12, chunks=4)
    >>> y = dask_overlap.map_blocks(lambda b: b * 2, x, split_axis=0, sub_chunk_bytes=8)
    >>> y.compute().tolist()
    [0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22]
    """
    # Every check comes before any work (inferring the dtype calls func), in this order.
    check_func(func)
    check_out_mode(out)
    opts = Options.from_config(sub_chunk_bytes=sub_chunk_bytes, in_flight=in_flight)
    positions = array_positions(arrays, chunks)
    check_inputs(arrays, positions, enforce_ndim, meta)
    ndim = max((arrays[i].ndim for i in positions), default=0)
    check_numblocks(arrays, positions, ndim)
    drop, new = check_axes("drop_axis", drop_axis, ndim), check_axes("new_axis", new_axis)
    check_output_axes(chunks, ndim - len(drop) + len(new), new, new_axis)
    if dtype is not None:
        check_dtype("dtype", dtype)  # the one given, before func is called to infer a meta
    out_split_axis = None
    if split_axis is not None:
        split_axis = check_split_axis(split_axis, ndim, drop_axis)
        out_split_axis = _out_axis(ndim, split_axis, drop, new, chunks)
    batch = check_batch(batch, split_axis, chunks, drop_axis)

    dtype, meta = _dtype_and_meta(
        func,
        arrays,
        kwargs,
        dtype=dtype,
        meta=meta,
        chunks=chunks,
        kept_ndim=ndim - len(drop) + len(new),
        backend=opts.backend,
        out_mode=out,
    )
    split_back = None  # batch="auto": the output's chunks along the split axis, kept
    token = token or funcname(func)
    if batch == "auto":
        batch = _auto_batch(
            func, arrays, positions, ndim, split_axis, chunks, drop_axis, opts.backend
        )
        if batch > 1:  # the blocks' extents along the axis, from an array joined
            _, x, ax = split_arrays(arrays, positions, ndim, split_axis)[0]
            split_back = x.chunks[ax]
            # The partition tasks are not the array returned: their names say whose
            # blocks they hold (partition i along the axis: blocks i*batch onwards).
            token = f"{token}-batch{batch}"
    task = _partition_task(
        func,
        opts,
        positions,
        ndim,
        split_axis,
        out_split_axis,
        out,
        batch,
        enforce_ndim,
        sub_chunk_bytes,
        in_flight,
    )
    if batch > 1:
        arrays = tuple(joined(arrays, positions, ndim, split_axis, batch))
    result = dask_map_blocks(
        task,
        *arrays,
        dtype=dtype,
        chunks=chunks,
        drop_axis=drop_axis,
        new_axis=new_axis,
        meta=meta,
        # A name given is the array returned: with batch="auto", the unbatched one.
        name=name if name is None or split_back is None else f"{name}-batch{batch}",
        token=token,
        **kwargs,
    )
    result = partition_layer(result, task)
    install_fusion()  # (Dask's array optimization then fuses what it can: see fusion.py)
    if split_back is not None:
        result = unbatched(result, out_split_axis, split_back, batch, name)
    return result
