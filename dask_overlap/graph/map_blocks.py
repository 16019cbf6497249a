"""The Dask glue: :func:`map_blocks`, thin on purpose.

It validates, then hands the graph to ``dask.array.map_blocks`` itself, with the user's
function wrapped in a picklable partition task, so chunk alignment, broadcasting,
constants, delayed arguments, ``drop_axis``/``new_axis``, ``name``/``token`` and
``block_info``/``block_id`` behave exactly as Dask's do. The task runs the partition
through this process's (or this worker's) runtime.
"""

from __future__ import annotations

import math
import operator
import reprlib
import sys
from collections.abc import Callable, Sequence
from numbers import Integral
from typing import Any

import dask.array as da
import numpy as np
from dask.array.utils import compute_meta
from dask.base import is_dask_collection, tokenize
from dask.blockwise import Blockwise
from dask.highlevelgraph import HighLevelGraph, MaterializedLayer
from dask.utils import funcname, has_keyword

from ..backends import resolve_backend
from ..config import Options
from ..pipeline.current import get_runtime
from ..pipeline.layout import AUTO_MIN_BYTES, along
from ..pipeline.partition import OUT_MODES, PartitionSpec, run_partition
from ..pipeline.pieces import gather
from .aliases import alias_targets, layer_of, skip_aliases
from .infer import infer_dtype, refuse_subclasses

__all__ = ["map_blocks"]

try:  # Dask's task objects: private, but the way distributed's own P2P tasks opt out of fusion
    from dask._task_spec import Task as _DaskTask
except ImportError:  # pragma: no cover - an older or newer Dask: tasks stay fusable
    _DaskTask = None

_NUMERIC_KINDS = "biufc"


def _check_dtype(what: str, dtype: Any) -> None:
    dt = np.dtype(dtype)
    if dt.kind not in _NUMERIC_KINDS:
        raise TypeError(
            f"{what} must have a numeric or boolean dtype "
            f"(bool, integer, float or complex), got {dt}"
        )


def _as_list(axes: int | Sequence[int] | None) -> list[int]:
    if axes is None:
        return []
    if isinstance(axes, Integral):
        return [int(axes)]
    return [int(a) for a in axes]


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


# The task travels pickled with every partition, so what it knows of the output's chunks
# must not grow with their number: a regular axis is three numbers, an irregular one is
# kept up to this many blocks (past it, its extents go unchecked).
_MAX_IRREGULAR_BLOCKS = 1024


def _axis_extents(chunks: tuple[float, ...]) -> tuple | None:
    """One output axis's chunks, as the task carries them (see :func:`_block_shape`)."""
    known = not any(math.isnan(c) for c in chunks)
    if known and len(chunks) > 1 and len(set(chunks[:-1])) == 1:
        return ("regular", int(chunks[0]), int(chunks[-1]), len(chunks))
    if len(chunks) <= _MAX_IRREGULAR_BLOCKS:
        return ("each", tuple(chunks))
    return None


def _block_shape(axes: tuple[tuple | None, ...], block_id: tuple[int, ...]) -> tuple:
    """Block ``block_id``'s shape from its axes as the task carries them (see
    :func:`_axis_extents`); ``None`` for an extent not known (Dask's nan, or an irregular
    axis of too many blocks). One loop: it runs for every partition."""
    shape = []
    for axis, i in zip(axes, block_id, strict=True):
        if axis is None:
            shape.append(None)
        elif axis[0] == "regular":
            shape.append(axis[2] if i == axis[3] - 1 else axis[1])
        else:
            c = axis[1][i]
            shape.append(None if math.isnan(c) else int(c))
    return tuple(shape)


class _PartitionTask:
    """The callable Dask runs for each partition (picklable; tokenized by content)."""

    def __init__(
        self,
        func: Callable[..., Any],
        *,
        backend: str,
        array_positions: tuple[int, ...],
        ndim: int,
        split_axis: int | None,
        out_split_axis: int | None,
        sub_chunk_bytes: int | str,
        in_flight: int,
        func_block_id: bool,
        func_block_info: bool,
        out_mode: str = "host",
    ):
        self.func = func
        self.out_mode = out_mode  # one of OUT_MODES: where each output block is left
        self.backend = backend
        self.array_positions = array_positions
        self.ndim = ndim
        self.split_axis = split_axis
        self.out_split_axis = out_split_axis
        self.sub_chunk_bytes = sub_chunk_bytes
        self.in_flight = in_flight
        self.func_block_id = func_block_id
        self.func_block_info = func_block_info
        # What the output array declares, set by declare_output once Dask has built it. The
        # key name is the output's name (each partition's key starts with it); func's own
        # name stands in until then.
        self.key_name = funcname(func)
        self.out_chunks: tuple[tuple | None, ...] | None = None  # per axis: see _axis_extents
        self.out_dtype: np.dtype | None = None

    def declare_output(self, result: da.Array) -> None:
        """Take the name, chunks and dtype of the array Dask built around this task."""
        self.key_name = result.name
        self.out_chunks = tuple(_axis_extents(c) for c in result.chunks)
        self.out_dtype = result.dtype

    def __dask_tokenize__(self) -> Any:
        return (
            type(self).__name__,
            tokenize(self.func),
            self.backend,
            self.array_positions,
            self.split_axis,
            self.out_split_axis,
            self.sub_chunk_bytes,
            self.in_flight,
            self.out_mode,
        )

    def _run(self, args: tuple, block_id: tuple | None, block_info: dict | None, kwargs: dict):
        if self.func_block_id:
            kwargs = dict(kwargs, block_id=block_id)
        out_shape = None
        if self.out_chunks is not None and block_id is not None:
            out_shape = _block_shape(self.out_chunks, block_id)
        # In the fields' order, not by keyword: twelve keywords cost a dataclass's
        # __init__ more than the rest of the spec does, and this runs per partition.
        spec = PartitionSpec(
            (self.key_name, *(block_id or ())),  # key
            self.array_positions,
            self.ndim,
            self.split_axis,
            self.out_split_axis,
            self.sub_chunk_bytes,
            self.in_flight,
            block_info,
            self.key_name,  # func_name
            out_shape,
            self.out_dtype,
            self.out_mode,  # out
        )
        return run_partition(get_runtime(self.backend), self.func, args, kwargs, spec)

    def __call__(self, *args: Any, block_id: tuple | None = None, **kwargs: Any) -> Any:
        return self._run(args, block_id, None, kwargs)


class _PartitionTaskWithInfo(_PartitionTask):
    """The same, for a ``func`` that asks for ``block_info`` (Dask then builds it)."""

    def __call__(
        self,
        *args: Any,
        block_id: tuple | None = None,
        block_info: dict | None = None,
        **kwargs: Any,
    ) -> Any:
        return self._run(args, block_id, block_info, kwargs)


def _guard_gpu_kernels() -> None:
    """Before Dask pickles ``func``: CuPy kernels it closes over must not be copied in-process
    (see :mod:`dask_overlap.backends.kernel_pickling`). Only when CuPy is already
    imported, so CPU-only use never imports it."""
    if "cupy" not in sys.modules:
        return
    from ..backends.kernel_pickling import guard_kernel_pickling

    guard_kernel_pickling()


def _check_numblocks(arrays: Sequence[Any], positions: tuple[int, ...], ndim: int) -> None:
    """Blocks are paired by position (Dask 2026.8's map_blocks does not rechunk to align
    them): along each axis the arrays need the same number of blocks, or one, to broadcast.
    Dask itself fails only at compute, with "Shapes do not align"; say so here, naming the
    arrays."""
    for k in range(ndim):
        counts = {}
        for i in positions:
            ax = k - (ndim - arrays[i].ndim)
            if ax >= 0 and arrays[i].numblocks[ax] != 1:
                counts[i] = arrays[i].numblocks[ax]
        if len(set(counts.values())) > 1:
            found = ", ".join(f"arrays[{i}]: {n}" for i, n in counts.items())
            raise ValueError(
                "map_blocks pairs the arrays' blocks by position, so they need the same number "
                f"of blocks along each axis (or 1, to broadcast); along axis {k} {found} "
                "blocks: rechunk them alike first (e.g. b.rechunk(a.chunks))"
            )


def _check_batch(batch: Any, split_axis: int | None, chunks: Any, drop_axis: Any) -> int | str:
    """``batch`` as a positive int or ``"auto"``, and a number only where joining blocks
    is sound (``"auto"`` joins none where it is not: see :func:`_auto_batch`)."""
    if batch == "auto" and type(batch) is str:
        return batch
    if isinstance(batch, bool) or not isinstance(batch, Integral):
        raise TypeError(f"batch must be a positive integer or 'auto', got {batch!r}")
    if batch < 1:
        raise ValueError(f"batch must be at least 1 (1: one block per partition), got {batch}")
    if batch > 1 and split_axis is None:
        raise ValueError(
            f"batch={batch} joins {batch} blocks along split_axis into one partition, so it "
            "needs split_axis (the axis func is independent along); got split_axis=None"
        )
    if batch > 1 and chunks is not None:
        raise ValueError(
            f"batch={batch} gives each output block {batch} blocks' extent along split_axis, "
            "which chunks= would contradict: leave chunks out"
        )
    if batch > 1 and _as_list(drop_axis):
        # Dask joins the blocks along a dropped axis itself, before the task, and cannot
        # join the gathered blocks a batch hands the task.
        raise ValueError(
            f"batch={batch} cannot be combined with drop_axis={drop_axis}: Dask joins the "
            "blocks along a dropped axis itself; rechunk that axis to one block instead"
        )
    return int(batch)


def _split_arrays(
    arrays: Sequence[Any], positions: tuple[int, ...], ndim: int, split_axis: int
) -> list[tuple[int, Any, int]]:
    """``(position, array, its own axis)`` of each dask array with more than one block
    along ``split_axis`` (in the inputs' index space): those a batch joins. The others
    lack the axis or have one block along it, and are broadcast as they are."""
    found = []
    for i in positions:
        x = arrays[i]
        ax = split_axis - (ndim - x.ndim)
        if ax >= 0 and x.numblocks[ax] > 1:
            found.append((i, x, ax))
    return found


#: ``batch="auto"`` leaves at least this many partitions (where there were as many).
AUTO_MIN_PARTITIONS = 8


def _auto_batch(
    asks_which_block: bool,
    arrays: Sequence[Any],
    positions: tuple[int, ...],
    ndim: int,
    split_axis: int | None,
    chunks: Any,
    drop_axis: Any,
) -> int:
    """``batch="auto"``: how many blocks along ``split_axis`` make a partition of about
    ``AUTO_MIN_BYTES`` in, counting the arrays that would be joined (those with more than
    one block along it); 1 where joining is not sound (no ``split_axis``, ``chunks=``,
    ``drop_axis``), where ``func`` asks which block it has (``asks_which_block``: it
    takes ``block_id`` or ``block_info``, and a batch's would not be the output block's),
    where a block's size is not known, or where blocks are that large.

    The size is the one below which a partition is never cut into sub-chunks, and on the
    H200 partitions of it ran at 0.77-0.82 of the bound where 4 and 16 MiB ones ran at
    0.15-0.49 (``benchmarks/small_partitions.py``). It never leaves fewer than
    ``AUTO_MIN_PARTITIONS`` partitions: a small array's blocks stay spread over the
    cluster's workers and a worker's threads.
    """
    if split_axis is None or chunks is not None or _as_list(drop_axis):
        return 1
    if asks_which_block:
        return 1
    per_block, along_axis, across = 0, 1, 1
    for _, x, ax in _split_arrays(arrays, positions, ndim, split_axis):
        if any(math.isnan(c) for cs in x.chunks for c in cs):
            return 1  # an extent Dask does not know yet
        per_block += math.prod(max(cs) for cs in x.chunks) * x.dtype.itemsize
        along_axis = max(along_axis, x.numblocks[ax])
        across = max(across, x.npartitions // x.numblocks[ax])  # partitions beside each
    if per_block == 0:
        return 1
    batches = -(-AUTO_MIN_PARTITIONS // across)  # along the axis, for enough in all
    return max(1, min(AUTO_MIN_BYTES // per_block, along_axis // batches))


class _CutBack(MaterializedLayer):
    """The layer of :func:`_unbatched`'s slice tasks, which also says what it cuts: the
    ``batched`` array (the partitions' outputs), along ``axis``, ``k`` blocks a batch.
    A next ``batch="auto"`` stage that joins the same ``k`` blocks along that axis takes
    ``batched``'s blocks as they are (:func:`_joined`): the slices, and the join of them,
    are then never run."""

    def __init__(self, mapping: dict, batched: da.Array, axis: int, k: int):
        super().__init__(mapping)
        self.batched, self.axis, self.k = batched, axis, k


def _unbatched(
    y: da.Array, axis: int, chunks: tuple[int, ...], k: int, name: str | None
) -> da.Array:
    """``y``, whose blocks along ``axis`` are batches of ``k`` blocks of extents ``chunks``,
    cut back into those blocks (named ``name``, if given): one slice task a block, a view
    of its batch's output. (Dask's ``rechunk`` makes the same cut with a copy a block.)"""
    name = name or "overlap-unbatch-" + tokenize(y.name, axis, chunks, k)
    grid = [len(chunks) if d == axis else n for d, n in enumerate(y.numblocks)]
    offsets = [0] * len(chunks)  # where each block starts in its batch
    for j in range(len(chunks)):
        if j % k:
            offsets[j] = offsets[j - 1] + chunks[j - 1]
    dsk: dict = {}
    for idx in np.ndindex(*grid):
        j = idx[axis]
        lo = offsets[j]
        source = (y.name, *idx[:axis], j // k, *idx[axis + 1 :])
        dsk[(name, *idx)] = (operator.getitem, source, along(axis, lo, lo + chunks[j]))
    out_chunks = list(y.chunks)
    out_chunks[axis] = tuple(chunks)
    graph = HighLevelGraph.from_collections(name, _CutBack(dsk, y, axis, k), dependencies=[y])
    return da.Array(graph, name, tuple(out_chunks), meta=y._meta)


def _joined(
    arrays: Sequence[Any], positions: tuple[int, ...], ndim: int, axis: int, k: int
) -> list:
    """``arrays`` with every dask array's blocks gathered ``k`` at a time along ``axis``
    (in the inputs' index space): the partition tasks then get one :class:`Pieces` per
    array and partition. An array without that axis, or with one block along it, is
    broadcast as it is."""
    out = list(arrays)
    for i, x, ax in _split_arrays(arrays, positions, ndim, axis):
        cut = x.dask.layers.get(x.name)
        if isinstance(cut, _CutBack) and (cut.axis, cut.k) == (ax, k):
            out[i] = cut.batched  # an auto stage's blocks, batched as they were made
            continue
        # A concatenated or reordered x: gather the blocks its aliases stand for.
        subs = alias_targets(x.dask, [x.name])
        n = x.numblocks[ax]
        starts = range(0, n, k)
        name = "overlap-batch-" + tokenize(x.name, ax, k)
        grid = [len(starts) if d == ax else nb for d, nb in enumerate(x.numblocks)]
        dsk: dict = {}
        for idx in np.ndindex(*grid):
            first = idx[ax] * k
            keys = [(x.name, *idx[:ax], j, *idx[ax + 1 :]) for j in range(first, min(first + k, n))]
            dsk[(name, *idx)] = (gather, ax, *(subs.get(key, key) for key in keys))
        chunks = list(x.chunks)
        chunks[ax] = tuple(sum(x.chunks[ax][s : s + k]) for s in starts)
        deps = {layer_of(t) for t in subs.values()} if subs else {x.name}
        graph = HighLevelGraph(
            {**x.dask.layers, name: MaterializedLayer(dsk)},
            {**x.dask.dependencies, name: deps},
        ).cull_layers([name])
        out[i] = da.Array(graph, name, tuple(chunks), meta=x._meta)
    return out


def _check_func(func: Any) -> None:
    if not callable(func):
        raise TypeError(
            f"func must be callable, got {reprlib.repr(func)} of type {type(func).__name__}"
        )


def _check_out_mode(out: Any) -> None:
    if out not in OUT_MODES:
        raise ValueError(f"out must be one of {', '.join(map(repr, OUT_MODES))}; got {out!r}")


def _array_positions(arrays: Sequence[Any], chunks: Any) -> tuple[int, ...]:
    """Where the dask arrays are among ``arrays``; the rest are passed through as they are."""
    positions = tuple(i for i, a in enumerate(arrays) if isinstance(a, da.Array))
    if not positions and chunks is None:
        raise ValueError(
            "map_blocks needs at least one dask array in arrays, or chunks= to build the "
            f"output from; got {len(arrays)} positional argument(s) and no dask array"
        )
    return positions


def _check_inputs(
    arrays: Sequence[Any], positions: tuple[int, ...], enforce_ndim: Any, meta: Any
) -> None:
    """``enforce_ndim`` is a bool; the arrays' blocks are plain arrays that a copy keeps whole
    and, like ``meta``, of a dtype a device array can hold."""
    if not isinstance(enforce_ndim, bool):
        raise TypeError(f"enforce_ndim must be True or False, got {enforce_ndim!r}")
    refuse_subclasses(arrays, positions)
    for i in positions:
        _check_dtype(f"arrays[{i}]", arrays[i].dtype)
    if meta is not None and hasattr(meta, "dtype"):
        _check_dtype("meta", meta.dtype)


def _check_split_axis(split_axis: Any, ndim: int, drop_axis: int | Sequence[int] | None) -> int:
    """``split_axis`` as a non-negative axis of the inputs, which the output keeps."""
    if isinstance(split_axis, bool) or not isinstance(split_axis, Integral):
        raise TypeError(f"split_axis must be an integer or None, got {split_axis!r}")
    if not -ndim <= split_axis < ndim:
        raise ValueError(
            f"split_axis must be in [{-ndim}, {ndim}) for inputs of {ndim} dimension(s), "
            f"got {split_axis}"
        )
    split_axis = int(split_axis) % ndim
    if split_axis in {d % ndim for d in _as_list(drop_axis)}:
        raise ValueError(
            f"split_axis={split_axis} is also in drop_axis={drop_axis}: the output must "
            "keep the split axis"
        )
    return split_axis


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
    if dtype is None:
        if any(is_dask_collection(a) and not isinstance(a, da.Array) for a in arrays):
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
        _check_dtype("the output of func (dtype)", dtype)
    if out_mode == "device" and isinstance(meta, np.ndarray) and resolve_backend(backend) == "cuda":
        import cupy

        meta = cupy.empty(meta.shape, meta.dtype)  # the chunks are CuPy arrays
    return dtype, meta


def _partition_task(
    func: Callable[..., Any],
    opts: Options,
    positions: tuple[int, ...],
    ndim: int,
    split_axis: int | None,
    out_split_axis: int | None,
    out_mode: str,
) -> _PartitionTask:
    """The task Dask maps over the blocks, asking for ``block_info`` only if ``func`` does."""
    task_type = _PartitionTaskWithInfo if has_keyword(func, "block_info") else _PartitionTask
    return task_type(
        func,
        backend=opts.backend,
        array_positions=positions,
        ndim=ndim,
        split_axis=split_axis,
        out_split_axis=out_split_axis,
        sub_chunk_bytes=opts.sub_chunk_bytes,
        in_flight=opts.in_flight,
        func_block_id=has_keyword(func, "block_id"),
        func_block_info=has_keyword(func, "block_info"),
        out_mode=out_mode,
    )


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
    split_axis
        Declares that ``func`` is independent along this axis: each partition is then
        cut along it into sub-chunks of about ``sub_chunk_bytes`` that are pipelined
        (the next copies in while one computes and the one before copies out). The
        output's extent along it must equal the input's. ``None`` (default): each
        partition is one sub-chunk.
    sub_chunk_bytes
        Target sub-chunk size, an int or a string such as ``"32MiB"``, or ``"auto"``
        (default ``overlap.sub-chunk-bytes``, ``auto``: cut a partition only as far as
        the partitions running beside it leave the device short of work).
    in_flight
        How many sub-chunks of a partition may be in flight at once (the bounded queue;
        default ``overlap.in-flight``). When it is full the submitter waits.
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
        ``batch=1``; elsewhere it is 1. A next auto stage that joins the same blocks
        takes those partitions' outputs as they are (the cut is then never run).
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
    _check_func(func)
    _check_out_mode(out)
    opts = Options.from_config(sub_chunk_bytes=sub_chunk_bytes, in_flight=in_flight)
    _guard_gpu_kernels()
    positions = _array_positions(arrays, chunks)
    _check_inputs(arrays, positions, enforce_ndim, meta)
    ndim = max((arrays[i].ndim for i in positions), default=0)
    _check_numblocks(arrays, positions, ndim)
    drop, new = _as_list(drop_axis), _as_list(new_axis)
    out_split_axis = None
    if split_axis is not None:
        split_axis = _check_split_axis(split_axis, ndim, drop_axis)
        out_split_axis = _out_axis(ndim, split_axis, drop, new, chunks)
    batch = _check_batch(batch, split_axis, chunks, drop_axis)

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
    task = _partition_task(func, opts, positions, ndim, split_axis, out_split_axis, out)
    split_back = None  # batch="auto": the output's chunks along the split axis, kept
    token = token or funcname(func)
    if batch == "auto":
        asks = task.func_block_id or task.func_block_info
        batch = _auto_batch(asks, arrays, positions, ndim, split_axis, chunks, drop_axis)
        if batch > 1:  # the blocks' extents along the axis, from an array joined
            _, x, ax = _split_arrays(arrays, positions, ndim, split_axis)[0]
            split_back = x.chunks[ax]
            # The partition tasks are not the array returned: their names say whose
            # blocks they hold (partition i along the axis: blocks i*batch onwards).
            token = f"{token}-batch{batch}"
    if batch > 1:
        arrays = tuple(_joined(arrays, positions, ndim, split_axis, batch))
    result = da.map_blocks(
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
    task.declare_output(result)
    _keep_unfused(result)
    result = skip_aliases(result)  # after: it materializes the tasks _keep_unfused marks
    if split_back is not None:
        result = _unbatched(result, out_split_axis, split_back, batch, name)
    return result


if _DaskTask is not None:

    class _UnfusedTask(_DaskTask):
        """A partition task that Dask's linear fusion leaves alone.

        Dask fuses a one-dependency chain (a ``from_array`` slice, then this partition)
        into one task that runs the chain as a subgraph, ordering it anew
        (``dask.order``) on every run: on small partitions that costs more than this
        library's own per-partition path (``benchmarks/host_overhead.py``), and on a
        worker it holds the GIL the stream threads need. Distributed's P2P tasks opt
        out the same way."""

        __slots__ = ()

        @property
        def block_fusion(self) -> bool:
            return True


#: The annotation that keeps Dask's blockwise fusion off a partition layer (its value is the
#: layer's name, so that two partition layers differ too).
PARTITION_ANNOTATION = "overlap_partition"


def _keep_unfused(result: da.Array) -> None:
    """Mark the partition layer so that every task of it stays its own task through
    Dask's two fusions:

    - linear fusion: its task template is an :class:`_UnfusedTask` (``Task.substitute``
      keeps the class);
    - blockwise fusion, which merges neighbouring ``Blockwise`` layers (an elementwise
      ``x * 2`` before the partitions, or one after them, or a reduction's first step)
      into one task per block, run as a subgraph. It merges two layers only where their
      annotations allow it, and one of a key of its own (:data:`PARTITION_ANNOTATION`)
      never does. On the host backend's synchronous path (2,000 partitions of 64 KiB, on
      a 2-core CPU machine), a partition fused with ``* 1`` after it cost about 740 µs
      against 340-420 µs as tasks of their own; one fused with ``x * 1`` before it, 625
      against 440-530. Where it reaches the scheduler (with Dask's low-level fusion
      off), distributed keeps it and acts on nothing. A user's annotations stay.
    """
    layer = result.dask.layers.get(result.name)
    if _DaskTask is None or not isinstance(layer, Blockwise) or type(layer.task) is not _DaskTask:
        return
    t = layer.task
    layer.task = _UnfusedTask(t.key, t.func, *t.args, _data_producer=t.data_producer, **t.kwargs)
    layer.annotations = {**(layer.annotations or {}), PARTITION_ANNOTATION: result.name}
