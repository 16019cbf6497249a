"""Reliability (issue 6): faults, cancellation, worker loss, pool exhaustion and odd input.

No hang (every wait is bounded), no leak (pools and windows end at zero), no wrong result
(bit for bit against NumPy or ``dask.array.map_blocks``). The cases run on the host
backend, in CI, and those marked ``gpu`` on the cuda backend (``pytest -m gpu
tests/test_reliability.py`` on the device; skipped where no GPU is visible). A case of both
is parametrized by backend: on the GPU its partitions are megabytes and its copies tens of
kilobytes, as a GPU sees them, and its functions are integer arithmetic or single
correctly rounded operations, whose CuPy results equal NumPy's bit for bit. The cases
only the GPU has come last. docs/guide/guarantees.md lists what they hold the library to.
"""

from __future__ import annotations

import _thread
import gc
import importlib
import re
import signal
import threading
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import cloudpickle
import dask
import dask.array as da
import numpy as np
import pytest
from dask.base import tokenize
from dask.core import flatten
from dask.highlevelgraph import HighLevelGraph
from dask.utils import parse_bytes
from distributed import Client, LocalCluster, futures_of
from support import (
    CLUSTER_KW,
    GPU_CONFIG,
    PLUGIN_OPTIONS,
    Boom,
    failing_at,
    hold,
    kill_a_busy_worker,
    pinned_in_use_once_collected,
    plugin,
    poll,
    release,
    require_gpu,
    rows_data,
    same_bits,
    wait_at,
    wait_until_idle,
)

import dask_overlap
from dask_overlap import runtime_stats
from dask_overlap.pipeline.runtime import process_runtimes

# These tests watch the ring with tiny arrays: every sub-chunk goes through it.
pytestmark = pytest.mark.usefixtures("ring_only")

# A case of both backends (indirect, through the ``backend`` fixture).
BACKENDS = ["host", pytest.param("cuda", marks=pytest.mark.gpu)]
# The same, for cluster cases that take a while on the GPU (its CI runs "gpu and not slow").
BACKENDS_SLOW_ON_GPU = ["host", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.slow])]


@pytest.fixture
def backend(request: pytest.FixtureRequest) -> Iterator[str]:
    """The backend a case is parametrized with; cuda under ``GPU_CONFIG`` (small pools)."""
    if request.param == "cuda":
        with dask.config.set(GPU_CONFIG):
            yield "cuda"
    else:
        yield "host"


@pytest.fixture
def cupy() -> Iterator[Any]:
    """CuPy, for the cases only the GPU has (each marked ``gpu``), under ``GPU_CONFIG``."""
    cp = require_gpu()
    with dask.config.set(GPU_CONFIG):
        yield cp


def array_module(backend: str) -> Any:
    """What ``func`` gets its blocks as on ``backend``: NumPy, or CuPy on the GPU."""
    return np if backend == "host" else importlib.import_module("cupy")


def same_as_dask(ours: da.Array, theirs: da.Array) -> np.ndarray:
    """Ours equals Dask's own map_blocks, bit for bit, and is the array it declares."""
    got, expected = dask.compute(ours, theirs)
    same_bits(got, expected)
    assert ours.dtype == got.dtype
    if not any(np.isnan(c) for cs in ours.chunks for c in cs):
        assert ours.shape == got.shape
    return got


def twice(b: np.ndarray) -> np.ndarray:
    return b * 2


def times_three(b: Any) -> Any:
    return b * 3


def device_bytes() -> int:
    """Bytes the runtime's device pool holds now (the host backend's: those in flight)."""
    return dask_overlap.runtime_stats()["device_bytes_in_use"]


def warm() -> int:
    """Build the runtime (on the GPU, CuPy's kernels too); the device bytes in use after."""
    x = da.from_array(np.arange(4096, dtype=np.int32).reshape(64, 64), chunks=(16, 64))
    dask_overlap.map_blocks(lambda b: b * 3 + 1, x, split_axis=0).compute()
    wait_until_idle()
    gc.collect()
    return device_bytes()


def settled(backend: str, device_before: int, timeout: float = 20.0) -> dict[str, Any]:
    """Once idle: nothing in flight, no pinned block held, device use back to where it was."""
    stats = wait_until_idle()
    assert stats["backend"] == backend and stats["in_flight"] == 0

    def back() -> bool:
        gc.collect()
        s = dask_overlap.runtime_stats()
        return s["pinned_bytes_in_use"] == 0 and s["device_bytes_in_use"] <= device_before

    poll(back, timeout, what="no pinned bytes held and the device back to its baseline")
    return dask_overlap.runtime_stats()


# == the threaded scheduler ============================================================


# -- 2. KeyboardInterrupt ---------------------------------------------------------------
@pytest.fixture
def ctrl_c() -> Iterator[None]:
    """Ctrl-C reaches Python for the test's duration, as it does in a terminal.

    A shell that runs the suite in the background (``pytest &``, some CI runners) starts
    it with SIGINT ignored, and ``_thread.interrupt_main`` then does nothing: it simulates
    the signal only where Python handles it. With Python's own handler installed here (and
    the previous one put back after), it raises KeyboardInterrupt in the main thread as a
    terminal's Ctrl-C would, whatever the shell; the tests still fail if the library
    swallows it.
    """
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        if previous is not None:  # None: a handler not installed from Python
            signal.signal(signal.SIGINT, previous)


def interrupt_at(row: int, how: str) -> Callable[[Any], Any]:
    fired = threading.Event()

    def func(b: Any) -> Any:
        if b.size and bool((b[:, 0] == row).any()) and not fired.is_set():
            fired.set()
            if how == "raise":
                raise KeyboardInterrupt
            _thread.interrupt_main()  # Ctrl-C in the caller, while this partition runs
        return b * 2

    return func


@pytest.mark.timeout(60)
@pytest.mark.usefixtures("ctrl_c")
@pytest.mark.parametrize("how", ["raise", "interrupt_main"])
@pytest.mark.parametrize("split_axis", [0, None])
def test_keyboard_interrupt_in_the_threaded_scheduler(how, split_axis):
    data = rows_data()
    x = da.from_array(data, chunks=(8, 4))
    kwargs = dict(split_axis=split_axis, sub_chunk_bytes=32, in_flight=3, dtype=x.dtype)
    y = dask_overlap.map_blocks(interrupt_at(12, how), x, **kwargs)
    with dask.config.set(num_workers=3), pytest.raises(KeyboardInterrupt):
        y.compute()
    stats = wait_until_idle()
    assert stats["in_flight"] == 0 and stats["device_bytes_in_use"] == 0
    assert pinned_in_use_once_collected() == 0
    if how == "raise":
        assert stats["partitions_failed"] == 1
    # nothing hung: the same runtime computes again
    z = dask_overlap.map_blocks(twice, x, **kwargs)
    same_bits(z.compute(), data * 2)
    assert wait_until_idle()["in_flight"] == 0


@pytest.mark.timeout(60)
@pytest.mark.usefixtures("ctrl_c")
@pytest.mark.parametrize("split_axis", [0, None])
def test_keyboard_interrupt_while_the_runner_waits(split_axis):
    """The synchronous scheduler: Ctrl-C lands in the partition's own submitter thread,
    while it waits for its streams; it still drains them before letting go."""
    data = rows_data()
    x = da.from_array(data, chunks=(8, 4))
    kwargs = dict(split_axis=split_axis, sub_chunk_bytes=32, in_flight=3, dtype=x.dtype)
    y = dask_overlap.map_blocks(interrupt_at(12, "interrupt_main"), x, **kwargs)
    with pytest.raises(KeyboardInterrupt):
        y.compute(scheduler="sync")
    stats = wait_until_idle()
    assert stats["in_flight"] == 0 and stats["partitions_active"] == 0
    assert pinned_in_use_once_collected() == 0
    same_bits(dask_overlap.map_blocks(twice, x, **kwargs).compute(scheduler="sync"), data * 2)


# -- a runtime closed under a running partition -----------------------------------------
GATE = threading.Event()  # set by the test; the second partition waits for it
AT_GATE: list[threading.Thread] = []  # the threads its func waits on


def gated(b: np.ndarray) -> np.ndarray:
    """Raise in the first partition (rows 0-7); wait at the gate in the second."""
    if b.size and b[0, 0] < 8:
        raise Boom("first partition")
    if b.size:
        AT_GATE.append(threading.current_thread())
        GATE.wait(30)  # bounded
    return b * 2


@pytest.mark.timeout(60)
@pytest.mark.parametrize("drain", [True, False], ids=["close-waits", "close-at-once"])
def test_runtime_closed_under_a_running_partition(drain):
    """A partition Dask left running (another one failed first) must not be stranded.

    ``close`` waits for it; and a stream closed under it anyway (``timeout=0``) still runs
    what it is given, so the partition ends instead of waiting forever for a completion.
    """
    GATE.clear()
    AT_GATE.clear()
    x = da.from_array(rows_data(16), chunks=(8, 4))
    y = dask_overlap.map_blocks(gated, x, split_axis=0, sub_chunk_bytes=32, dtype=x.dtype)
    rt = dask_overlap.get_runtime()
    with dask.config.set(num_workers=2), pytest.raises(Boom):
        y.compute()
    # the other partition, with its func at the gate (on its streams' threads)
    poll(lambda: rt.counters.partitions_active == 1 and AT_GATE)

    def under_way() -> bool:
        if drain:  # close() has begun: it waits for the partition
            return rt.closed
        # close() has closed a stream the partition's func runs on (and waits for it)
        return any(s._closed and s._thread in AT_GATE for s in rt.streams)

    def open_once_under_way() -> None:
        try:
            poll(under_way, 30, what="close() under way")
        finally:
            GATE.set()

    opener = threading.Thread(target=open_once_under_way)
    opener.start()
    if drain:
        rt.close()
        assert rt.counters.partitions_active == 0  # close returned after it was done
    else:
        rt.close(timeout=0)  # streams closed while it still has sub-chunks to run
        poll(lambda: rt.counters.partitions_active == 0)
    opener.join(30)
    assert rt.counters.in_flight == 0


# -- 4. pinned pool smaller than one partition's output and than one sub-chunk -----------
@pytest.mark.timeout(60)
@pytest.mark.parametrize("fuse", [False, True], ids=["stages", "fused"])
@pytest.mark.parametrize(
    "pool", [0, 200, 5000], ids=["no-pool", "below-a-sub-chunk", "below-a-partition"]
)
def test_small_pinned_pool_chained_on_many_threads(pool, fuse):
    """Outputs fed straight into a second map_blocks, 4 threads, pool short everywhere
    (the stages as they were built, or fused into one partition a block)."""
    data = np.random.default_rng(1).standard_normal((480, 32))  # 256 B rows, 32 kB chunks
    x = da.from_array(data, chunks=(128, 32))
    config = {"overlap.pinned-pool-size": pool, "num_workers": 4, "overlap.fuse": fuse}
    with dask.config.set(config):
        dask_overlap.close_runtimes()  # a runtime built from this config
        y = dask_overlap.map_blocks(np.negative, x, split_axis=0, sub_chunk_bytes=1024)
        z = dask_overlap.map_blocks(np.sqrt, np.abs(y), split_axis=0, sub_chunk_bytes=4096)
        same_bits(z.compute(), np.sqrt(np.abs(-data)))
    stats = wait_until_idle()
    assert stats["pinned_pool_size"] == pool
    assert stats["pinned_bytes_peak"] <= pool
    if not fuse:
        assert stats["pinned_fallbacks"] >= 2 * x.npartitions  # every output fell back
    elif pool < 2 * 1024:  # no room for a sub-chunk's way in and out
        assert stats["pinned_fallbacks"] >= x.npartitions
    else:  # fused, one copy in and one out a sub-chunk: the ring holds them
        assert stats["pinned_fallbacks"] == 0
    assert stats["in_flight"] == 0
    assert pinned_in_use_once_collected() == 0
    if pool < 1024:  # not one staging buffer fits
        assert stats["bytes_staged"] == 0


# One chunk of int32 rows (1 MiB on the host, 8 MiB on the GPU), a pinned pool of a
# sixteenth of it and sub-chunks of a quarter of the pool.
ONE_CHUNK = {"host": (8192, 32, "64KiB", "16KiB"), "cuda": (8192, 256, "1MiB", "256KiB")}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
def test_one_chunk_larger_than_the_pinned_pool(backend):
    rows, cols, pool, sub = ONE_CHUNK[backend]
    a = np.arange(rows * cols, dtype=np.int32).reshape(rows, cols)
    x = da.from_array(a, chunks=-1)
    with dask.config.set({"overlap.pinned-pool-size": pool}):
        dask_overlap.close_runtimes()
        for split_axis in (None, 0):
            y = dask_overlap.map_blocks(times_three, x, split_axis=split_axis, sub_chunk_bytes=sub)
            same_bits(y.compute(), a * 3)
    stats = wait_until_idle()
    assert stats["backend"] == backend
    assert stats["pinned_fallbacks"] > 0
    assert stats["bytes_staged"] > 0  # the sub-chunks still went through the pool
    assert stats["pinned_bytes_peak"] <= parse_bytes(pool)
    assert pinned_in_use_once_collected() == 0


# -- 5. out of memory in func: host memory, or the device's on the GPU -------------------
# Rows and columns of float32, rows per partition (three partitions), the row whose
# sub-chunk runs out, the sub-chunk bytes, and the bytes asked for: more than any machine
# has (2**62), or than any device pool (64 TiB).
OUT_OF_MEMORY = {"host": (24, 4, 8, 13, 16, 2**62), "cuda": (3072, 256, 1024, 1100, 65536, 2**46)}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("split_axis", [0, None])
@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
def test_out_of_memory_names_the_partition_and_the_bytes(backend, split_axis):
    rows, cols, chunk, row, sub, ask = OUT_OF_MEMORY[backend]
    xp = array_module(backend)
    device_before = warm()
    data = rows_data(rows, cols, np.float32)
    x = da.from_array(data, chunks=(chunk, cols))

    def greedy(b: Any) -> Any:
        if b.size and bool((b[:, 0] == row).any()):
            xp.empty(ask, dtype=np.uint8)
        return b + 1

    y = dask_overlap.map_blocks(
        greedy, x, split_axis=split_axis, sub_chunk_bytes=sub, dtype=x.dtype
    )
    with pytest.raises(MemoryError) as info:
        y.compute()
    msg = str(info.value)
    assert f"partition ('{y.name}', 1, 0)" in msg, msg
    assert "greedy" in msg and f"{ask:,} bytes" in msg, msg
    assert ("device" if backend == "cuda" else "host memory") in msg, msg
    assert isinstance(info.value.__cause__, MemoryError)
    del info
    stats = settled(backend, device_before)
    assert stats["partitions_failed"] == 1
    # the runtime (the device) is still usable
    same_bits(dask_overlap.map_blocks(lambda b: b + 1, x).compute(), data + 1)


def test_other_errors_are_not_called_out_of_memory():
    backend = dask_overlap.get_runtime().backend
    assert backend.describe_oom(ValueError("allocating 8 bytes")) is None
    assert backend.describe_oom(KeyboardInterrupt()) is None
    assert "unknown number of bytes" in backend.describe_oom(MemoryError())


# -- 6. output dtype or shape other than declared ---------------------------------------
def declared_error(y: da.Array, *fragments: Any):
    pattern = "".join(f"(?=.*{re.escape(str(f))})" for f in ("declares", *fragments))
    return pytest.raises(ValueError, match=re.compile(pattern, re.S))


@pytest.mark.parametrize("split_axis", [None, 0, 1])
def test_output_dtype_other_than_declared(split_axis):
    x = da.from_array(rows_data(), chunks=(8, 4))
    y = dask_overlap.map_blocks(
        lambda b: b * 2, x, dtype=np.float32, split_axis=split_axis, sub_chunk_bytes=32
    )
    assert y.dtype == np.float32  # what Dask's array says: the result must be that
    with declared_error(y, "float64", "float32", f"partition ('{y.name}', ", "lambda"):
        y.compute()
    # meta= declares the dtype too
    y = dask_overlap.map_blocks(lambda b: b.astype(np.int32), x, meta=np.empty((0, 0), np.int64))
    with declared_error(y, "int32", "int64", y.name):
        y.compute()


@pytest.mark.parametrize("split_axis", [None, 0])
def test_output_shape_other_than_declared(split_axis):
    x = da.from_array(rows_data(), chunks=(8, 4))
    widen = lambda b: np.concatenate([b, b], axis=1)  # noqa: E731
    y = dask_overlap.map_blocks(widen, x, split_axis=split_axis, sub_chunk_bytes=32)
    with declared_error(y, "(8, 8)", "(8, 4)", f"partition ('{y.name}', "):
        y.compute()
    # with chunks= saying so, it is what Dask gives
    ok = dict(chunks=(8, 8))
    same_as_dask(
        dask_overlap.map_blocks(widen, x, split_axis=split_axis, sub_chunk_bytes=32, **ok),
        da.map_blocks(widen, x, **ok),
    )


def test_new_axis_without_chunks_declares_extent_one():
    """Dask declares extent 1 on a new axis unless chunks= says otherwise."""
    x = da.from_array(rows_data(), chunks=(8, 4))
    stack = lambda b: np.stack([b, -b], axis=1)  # noqa: E731
    y = dask_overlap.map_blocks(stack, x, new_axis=1)
    with declared_error(y, "(8, 2, 4)", "(8, 1, 4)", y.name):
        y.compute()
    one = lambda b: b[:, None, :]  # noqa: E731
    same_as_dask(dask_overlap.map_blocks(one, x, new_axis=1), da.map_blocks(one, x, new_axis=1))


@pytest.mark.parametrize("split_axis", [None, 0])
def test_unknown_chunks_skip_the_shape_check(split_axis):
    a = rows_data(40)
    x = da.from_array(a, chunks=(10, 4))
    sel = x[x[:, 0] % 3 != 0]  # unknown (nan) extents along axis 0
    assert np.isnan(sel.chunks[0][0])
    f = lambda b: b * 3  # noqa: E731
    got = same_as_dask(
        dask_overlap.map_blocks(f, sel, split_axis=split_axis, sub_chunk_bytes=32),
        da.map_blocks(f, sel),
    )
    same_bits(got, a[a[:, 0] % 3 != 0] * 3)
    # the known axis is still checked
    y = dask_overlap.map_blocks(lambda b: b[:, :2], sel, split_axis=split_axis)
    with declared_error(y, "('?', 4)", y.name):
        y.compute()


def task_bytes(y: da.Array) -> int:
    key = next(flatten(y.__dask_keys__()))
    return len(cloudpickle.dumps(dict(y.__dask_graph__())[key]))


def test_what_each_task_carries_does_not_grow_with_the_partitions():
    """The declared chunks travel pickled with every task: not O(partitions) each."""
    small = dask_overlap.map_blocks(twice, da.zeros((10, 3), chunks=(1, 3)))
    big = dask_overlap.map_blocks(twice, da.zeros((20_000, 3), chunks=(1, 3)))
    assert abs(task_bytes(big) - task_bytes(small)) < 64
    # many irregular blocks: the extents along that axis are not carried, nor checked
    sizes = (1, 2) * 1000
    irregular = da.zeros((sum(sizes), 3), chunks=(sizes, 3))
    few = da.zeros((9, 3), chunks=((1, 2) * 3, 3))
    y = dask_overlap.map_blocks(first_row, irregular)
    assert task_bytes(y) < task_bytes(dask_overlap.map_blocks(first_row, few)) + 64
    assert y.compute().shape == (len(sizes), 3)
    y = dask_overlap.map_blocks(first_col, irregular)  # the other axis still is
    with declared_error(y, ", 1)", "('?', 3)", y.name):
        y.compute()


def first_row(b: np.ndarray) -> np.ndarray:
    return b[:1]


def first_col(b: np.ndarray) -> np.ndarray:
    return b[:, :1]


# -- 7. odd inputs, against dask.array.map_blocks ---------------------------------------
def keep(b: np.ndarray) -> np.ndarray:
    return b.copy()


def both_ways(func: Callable, *arrays: da.Array, **kwargs: Any) -> None:
    """Ours equals Dask's, whole partitions and as sub-chunks along every axis."""
    theirs = da.map_blocks(func, *arrays, **kwargs)
    ndim = max(a.ndim for a in arrays)
    for split_axis in [None, *range(ndim)]:
        ours = dask_overlap.map_blocks(
            func, *arrays, split_axis=split_axis, sub_chunk_bytes=16, **kwargs
        )
        same_as_dask(ours, theirs)


@pytest.mark.parametrize(
    "shape, chunks",
    [((0,), 4), ((0, 5), (2, 2)), ((6, 0), (4, 3)), ((0, 0, 3), 1)],
    ids=["0", "0x5", "6x0", "0x0x3"],
)
def test_empty_arrays(shape, chunks):
    x = da.from_array(np.ones(shape, np.float32), chunks=chunks)
    both_ways(twice, x)


def test_empty_chunks_among_full_ones():
    a = np.arange(30.0).reshape(6, 5)
    x = da.from_array(a, chunks=((3, 0, 2, 0, 1), (0, 5)))
    both_ways(twice, x)
    y = da.from_array(np.arange(5.0), chunks=((0, 5, 0),))
    both_ways(twice, y)


def test_zero_d_arrays():
    x = da.from_array(np.float64(3.5))
    y = da.from_array(np.array(7, np.int16))
    same_as_dask(dask_overlap.map_blocks(twice, x), da.map_blocks(twice, x))
    f = lambda u, v: u * v  # noqa: E731
    same_as_dask(dask_overlap.map_blocks(f, x, y), da.map_blocks(f, x, y))
    z = da.from_array(np.arange(12.0).reshape(3, 4), chunks=(2, 2))  # 0-d broadcast
    both_ways(f, z, x)


def test_fortran_ordered_inputs_and_outputs():
    a = np.asfortranarray(np.arange(7 * 9 * 4, dtype=np.int32).reshape(7, 9, 4))
    x = da.from_array(a, chunks=(3, 4, 4))
    both_ways(twice, x)
    both_ways(lambda b: np.asfortranarray(b + 1), x)  # F-ordered result too


def view_chunks(a: np.ndarray, rows: int, cols: int) -> da.Array:
    """A dask array whose blocks are views of ``a`` as they are (no copy, any strides)."""
    name = f"views-{tokenize(a, a.strides)}"
    r0, c0 = range(0, a.shape[0], rows), range(0, a.shape[1], cols)
    dsk = {
        (name, i, j): a[r : r + rows, c : c + cols]
        for i, r in enumerate(r0)
        for j, c in enumerate(c0)
    }
    assert not any(b.flags.c_contiguous for b in dsk.values())
    chunks = tuple(
        tuple(min(step, n - s) for s in starts)
        for step, n, starts in ((rows, a.shape[0], r0), (cols, a.shape[1], c0))
    )
    graph = HighLevelGraph.from_collections(name, dsk, dependencies=())
    return da.Array(graph, name, chunks, meta=a[:0, :0])


@pytest.mark.parametrize(
    "view",
    [
        lambda a: a[::2, 1::3],
        lambda a: a[::-1],
        lambda a: a[:, ::-2],
        lambda a: a.T,
        lambda a: np.broadcast_to(a[:1], a.shape),  # zero strides
    ],
    ids=["strided", "reversed", "reversed-cols", "transposed", "zero-stride"],
)
def test_non_contiguous_chunks(view):
    base = np.arange(40 * 30, dtype=np.float64).reshape(40, 30)
    x = view_chunks(view(base), 7, 6)
    both_ways(twice, x)


@pytest.mark.parametrize("dtype", [">f8", ">i4", ">c16", ">u2"])
def test_big_endian_dtypes(dtype):
    a = (np.arange(60) - 17).astype(dtype).reshape(12, 5)
    x = da.from_array(a, chunks=(5, 3))
    both_ways(twice, x)  # native-order result
    both_ways(keep, x)  # big-endian result


def test_chunks_that_do_not_align():
    """Blocks pair by position: other chunkings work when the block counts agree (or are
    1, to broadcast), and fail at construction, naming the arrays, when they do not."""
    a = np.arange(24.0 * 10).reshape(24, 10)
    x = da.from_array(a, chunks=(5, 4))  # 5 x 3 blocks
    y = da.from_array(a[::-1].copy(), chunks=((4, 6, 4, 6, 4), (2, 6, 2)))  # 5 x 3, other sizes
    row = da.from_array(np.arange(10.0)[None, :], chunks=(1, 4))  # 1 x 3: broadcasts
    whole = da.from_array(np.arange(10.0), chunks=10)  # one block: broadcasts
    f = lambda u, v, w, z: u[:, :1] - v[:1, :1] * w[:1, :1] + z[:1]  # noqa: E731
    kwargs = dict(chunks=(x.chunks[0], (1,) * 3), dtype=np.float64)
    same_as_dask(
        dask_overlap.map_blocks(f, x, y, row, whole, **kwargs),
        da.map_blocks(f, x, y, row, whole, **kwargs),
    )
    g = lambda u, v: u + v  # noqa: E731
    for other, axis, counts in [
        (da.from_array(a, chunks=(7, 4)), 0, "arrays[0]: 5, arrays[1]: 4"),
        (da.from_array(np.arange(10.0), chunks=6), 1, "arrays[0]: 3, arrays[1]: 2"),
    ]:
        with pytest.raises(ValueError, match=re.escape(f"along axis {axis} {counts} blocks")):
            dask_overlap.map_blocks(g, x, other)
        same_as_dask(
            dask_overlap.map_blocks(g, x, other.rechunk(x.chunks[-other.ndim :])),
            da.map_blocks(g, x, other.rechunk(x.chunks[-other.ndim :])),
        )


def test_very_uneven_chunks():
    a = np.random.default_rng(2).standard_normal((1000, 3))
    x = da.from_array(a, chunks=((1, 990, 2, 1, 6), (2, 1)))
    both_ways(np.sin, x)


# == a real multi-process cluster ======================================================
@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    with LocalCluster(n_workers=2, threads_per_worker=3, processes=True, **CLUSTER_KW) as c:
        yield c


def register(client: Client, backend: str = "host", **options: Any) -> None:
    """A fresh plugin, so fresh runtimes with zeroed counters, on every worker."""
    client.register_plugin(plugin(backend, **options))


@pytest.fixture
def client(cluster: LocalCluster, request: pytest.FixtureRequest) -> Iterator[Client]:
    """A client of the module's cluster, its workers' plugin of the case's backend."""
    backend = request.getfixturevalue("backend") if "backend" in request.fixturenames else "host"
    with Client(cluster) as client:
        register(client, backend)
        yield client


def idle_and_empty(client: Client, backend: str = "host") -> dict[str, dict[str, Any]]:
    """Every worker's stats once nothing runs and nothing is held (bounded wait)."""
    held = ("partitions_active", "in_flight", "pinned_bytes_in_use")
    if backend == "host":
        # (on the GPU, CuPy may keep device memory between tasks: the threaded cases
        # compare it with a baseline instead)
        held += ("device_bytes_in_use",)

    def check() -> dict[str, dict[str, Any]] | None:
        client.run(gc.collect)
        stats = client.run(runtime_stats)
        return stats if all(s[k] == 0 for s in stats.values() for k in held) else None

    stats = poll(check, timeout=30, what="every worker idle and empty")
    pool = parse_bytes(str(PLUGIN_OPTIONS[backend]["pinned_pool_size"]))
    for s in stats.values():
        assert s["backend"] == backend
        assert s["pinned_bytes_peak"] <= s["pinned_pool_size"] == pool
    return stats


def total(stats: dict[str, dict[str, Any]], key: str) -> int:
    return sum(s[key] for s in stats.values())


def int_data(rows: int, cols: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(-(2**20), 2**20, (rows, cols), dtype=np.int32)


# -- 1. func raises in one sub-chunk, on a cluster --------------------------------------
@pytest.mark.timeout(120)
@pytest.mark.parametrize("row", [8, 12, 15], ids=["first", "middle", "last"])
def test_func_raises_on_a_cluster(client: Client, row: int) -> None:
    data = rows_data()
    x = da.from_array(data, chunks=(8, 4))  # three partitions of eight one-row sub-chunks
    kwargs = dict(split_axis=0, sub_chunk_bytes=32, in_flight=3, dtype=x.dtype)
    y = dask_overlap.map_blocks(failing_at(row), x, **kwargs)
    with pytest.raises(Boom) as info:
        client.compute(y, sync=True)
    assert type(info.value) is Boom and str(info.value) == f"row {row} is cursed"
    del info
    stats = idle_and_empty(client)
    assert total(stats, "partitions_failed") == 1
    # the next computation on the same cluster succeeds
    z = dask_overlap.map_blocks(twice, x, **kwargs)
    same_bits(client.compute(z, sync=True), data * 2)
    stats = idle_and_empty(client)
    assert total(stats, "partitions_failed") == 1


# -- 2. client.cancel on a running computation ------------------------------------------
@pytest.mark.timeout(120)
def test_cancel_a_running_computation(client: Client) -> None:
    gate = f"cancelled-{uuid.uuid4().hex}"
    client.run(hold, gate)

    def held(b: np.ndarray) -> np.ndarray:
        # Every sub-chunk waits (bounded) until the test has cancelled: it is cancelled
        # while running, whatever the machine's speed.
        if b.size:
            wait_at(gate, 30)
        return b * 2

    data = rows_data(320, 8)
    x = da.from_array(data, chunks=(16, 8))  # 20 partitions of four sub-chunks
    y = dask_overlap.map_blocks(held, x, split_axis=0, sub_chunk_bytes=256, dtype=x.dtype)
    fut = client.compute(y)
    poll(lambda: total(client.run(runtime_stats), "partitions_active") > 0)
    client.cancel(fut)
    poll(lambda: fut.cancelled())
    client.run(release, gate)  # the partitions already running finish on their own
    stats = idle_and_empty(client)
    assert 0 < total(stats, "partitions") < x.npartitions  # the rest never started
    same_bits(client.compute(y, sync=True), data * 2)  # the same graph, again
    idle_and_empty(client)


# -- 4. pinned pool short on the workers ------------------------------------------------
@pytest.mark.timeout(120)
@pytest.mark.parametrize("pool", [100, 3000], ids=["below-a-sub-chunk", "below-a-partition"])
def test_small_pinned_pool_on_a_cluster(client: Client, pool: int) -> None:
    register(client, pinned_pool_size=pool)
    data = np.random.default_rng(4).standard_normal((600, 16))  # 128 B rows, 6 kB chunks
    x = da.from_array(data, chunks=(48, 16))
    y = dask_overlap.map_blocks(np.exp, x, split_axis=0, sub_chunk_bytes=1024)
    same_bits(client.compute(y, sync=True), np.exp(data))

    def check() -> dict | None:
        client.run(gc.collect)
        stats = client.run(runtime_stats)
        done = all(
            s["partitions_active"] == 0 and s["pinned_bytes_in_use"] == 0 for s in stats.values()
        )
        return stats if done else None

    stats = poll(check)
    assert all(s["pinned_bytes_peak"] <= s["pinned_pool_size"] == pool for s in stats.values())
    assert total(stats, "pinned_fallbacks") >= x.npartitions  # every output fell back
    assert total(stats, "partitions") == x.npartitions


# -- 8. stress: 1,000 partitions, random sizes, two workers of three threads ------------
# The most rows of a partition, the int32 columns and the range of sub-chunk bytes: most
# partitions are cut in several sub-chunks, some are one.
STRESS = {"host": (24, 12, (48, 600)), "cuda": (96, 256, (1024, 64 * 1024))}


def stress_data(backend: str, seed: int) -> tuple[da.Array, np.ndarray, int, int]:
    """1,000 partitions of random sizes, made where they are used (on the GPU, a graph
    carrying the data would be tens of MiB), the same data here, for the reference, and
    two random sub-chunk sizes."""
    max_rows, cols, subs = STRESS[backend]
    rng = np.random.default_rng(seed)
    sizes = tuple(int(n) for n in rng.integers(1, max_rows, size=1000))
    sub1, sub2 = (int(n) for n in rng.integers(*subs, size=2))
    x = da.random.default_rng(seed).integers(
        -(2**20), 2**20, size=(sum(sizes), cols), chunks=(sizes, cols), dtype=np.int32
    )
    assert x.npartitions == 1000
    return x, x.compute(scheduler="threads"), sub1, sub2


def stress_graph(x: da.Array, sub1: int, sub2: int) -> da.Array:
    # A thousand partitions (batch=1: none joined), each cut into sub-chunks.
    y = dask_overlap.map_blocks(
        lambda b: b * 3 + 1, x, split_axis=0, batch=1, sub_chunk_bytes=sub1, in_flight=3
    )
    # the second stage reads the first's outputs where they are (pinned when local)
    return dask_overlap.map_blocks(
        lambda b: (b ^ 0x5A5A) - 7, y, split_axis=0, batch=1, sub_chunk_bytes=sub2
    )


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
def test_stress_a_thousand_partitions(client: Client, backend: str) -> None:
    x, data, sub1, sub2 = stress_data(backend, seed=8)
    got = client.compute(stress_graph(x, sub1, sub2), sync=True)
    same_bits(got, ((data * 3 + 1) ^ 0x5A5A) - 7)
    stats = idle_and_empty(client, backend)
    # The two stages are fused: one partition a block, one copy out.
    assert total(stats, "partitions") == 1000
    assert total(stats, "partitions_failed") == 0
    assert total(stats, "sub_chunks") > 1000
    assert total(stats, "bytes_d2h") == data.nbytes
    assert all(s["partitions"] > 0 for s in stats.values()), "both workers took part"


# -- 9. two clients through the same workers at once ------------------------------------
# Rows and int32 columns of each client's array, rows per partition, the two clients'
# sub-chunk bytes and the pinned pool: the ring (half of it) holds a few sub-chunks' way in
# and out, so the bound binds.
TWO_CLIENTS = {
    "host": (960, 64, 24, 2048, 1024, "16KiB"),
    "cuda": (2048, 256, 64, 8192, 16384, "256KiB"),
}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("backend", BACKENDS_SLOW_ON_GPU, indirect=True)
def test_two_clients_at_once(cluster: LocalCluster, backend: str) -> None:
    rows, cols, chunk, sub_a, sub_b, pool = TWO_CLIENTS[backend]
    a_data, b_data = int_data(rows, cols, seed=9), int_data(rows, cols, seed=10)
    last = (rows - 1) // chunk
    gate = f"b-has-run-{uuid.uuid4().hex}"

    def a_func(blk: Any, block_id: tuple | None = None) -> Any:
        # A's last partition ends only once B has finished a partition: they overlap.
        if blk.size and block_id is not None and block_id[0] == last and not wait_at(gate, 60):
            raise TimeoutError("client B never ran while A was running")
        return blk * 3 + 1

    with Client(cluster, set_as_default=False) as ca, Client(cluster, set_as_default=False) as cb:
        register(ca, backend, pinned_pool_size=pool)
        ca.run(hold, gate)
        a = dask_overlap.map_blocks(
            a_func,
            da.from_array(a_data, chunks=(chunk, cols)),
            split_axis=0,
            batch=1,
            sub_chunk_bytes=sub_a,
        )
        b = dask_overlap.map_blocks(
            lambda blk: blk ^ 5,
            da.from_array(b_data, chunks=(chunk, cols)),
            split_axis=0,
            batch=1,
            sub_chunk_bytes=sub_b,
        )
        fa = ca.compute(a)
        b_kept = cb.persist(b)  # partition by partition: one can finish while A's is held
        parts = futures_of(b_kept)
        poll(lambda: any(f.done() for f in parts), 60, what="a partition of B done")
        assert not fa.done()
        ca.run(release, gate)
        same_bits(fa.result(timeout=120), a_data * 3 + 1)
        same_bits(cb.compute(b_kept, sync=True), b_data ^ 5)
        del fa, b_kept
        parts.clear()  # no future of theirs is kept
        stats = poll(
            lambda: (
                (s := ca.run(runtime_stats))
                and all(v["partitions_active"] == 0 for v in s.values())
                and s
            )
        )
        assert total(stats, "partitions") == a.npartitions + b.npartitions
        assert all(s["pinned_bytes_peak"] <= s["pinned_pool_size"] for s in stats.values())
        assert total(stats, "ring_full") > 0  # the bound was reached, and held:
        # sub-chunks waited for room instead of falling back. On the GPU, RMM's free list
        # can fragment in a pool this small, so a block can fail to come even when the
        # budget has room (seen once on the H200: 1 of 512 buffers); that one goes through
        # pageable memory, counted, and must stay rare.
        rare = 0 if backend == "host" else total(stats, "sub_chunks") // 50
        assert total(stats, "pinned_fallbacks") <= rare


# -- 3. a worker process killed mid-computation -----------------------------------------
# Rows and int32 columns, rows per partition (20 or 32 partitions), the sub-chunk bytes.
KILLED = {"host": (480, 32, 24, 512), "cuda": (2048, 256, 64, None)}


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
def test_worker_killed_mid_computation(backend: str) -> None:
    rows, cols, chunk, sub = KILLED[backend]
    data = int_data(rows, cols, seed=3)
    half = rows // chunk // 2
    gate = f"killed-{uuid.uuid4().hex}"

    def held_back(blk: Any, block_id: tuple | None = None) -> Any:
        # The second half waits for the kill, so the computation cannot end before it
        # (bounded; the nanny's new worker never held the gate).
        if blk.size and block_id is not None and block_id[0] >= half:
            wait_at(gate, 60)
        return blk * 3 + 1

    with (
        LocalCluster(n_workers=2, threads_per_worker=2, processes=True, **CLUSTER_KW) as cluster,
        Client(cluster) as client,
    ):
        register(client, backend)
        client.run(hold, gate)
        x = da.from_array(data, chunks=(chunk, cols))
        y = dask_overlap.map_blocks(held_back, x, split_axis=0, sub_chunk_bytes=sub)
        fut = client.compute(y)
        victim = kill_a_busy_worker(client, fut)
        client.run(release, gate)
        same_bits(fut.result(timeout=180), data * 3 + 1)
        # the nanny brought a worker back, with its own runtime from the plugin
        poll(lambda: len(client.scheduler_info()["workers"]) == 2, timeout=60)
        stats = poll(
            lambda: (
                (s := client.run(runtime_stats))
                and all(v["backend"] == backend and v["partitions_active"] == 0 for v in s.values())
                and s
            )
        )
        assert victim not in stats


# -- fork: a child starts with no runtime of its parent's (#13 item 3) ---------------------
def _in_forked_child(queue: Any) -> None:
    from dask_overlap.process import registries

    emptied = all(not reg.items for reg in registries())
    x = da.from_array(np.arange(64.0).reshape(16, 4), chunks=(4, 4))
    y = dask_overlap.map_blocks(np.negative, x, split_axis=0, sub_chunk_bytes=32)
    # The synchronous scheduler: Dask's own thread pool does not survive a fork either.
    queue.put((emptied, y.compute(scheduler="sync")))


@pytest.mark.timeout(60)
def test_a_forked_child_builds_its_own_runtime():
    import multiprocessing

    x = da.from_array(np.arange(64.0).reshape(16, 4), chunks=(4, 4))
    dask_overlap.map_blocks(np.negative, x, split_axis=0, sub_chunk_bytes=32).compute()
    assert process_runtimes()  # the parent has one, with its threads
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=_in_forked_child, args=(queue,))
    child.start()
    emptied, got = queue.get(timeout=45)  # before the fix: the child hung here
    child.join(15)
    assert child.exitcode == 0
    assert emptied
    np.testing.assert_array_equal(got, -np.arange(64.0).reshape(16, 4))


# -- no hang when a stream's thread is gone or a callback raises (#13 item 6) ------------
@pytest.mark.timeout(60)
def test_partitions_complete_when_the_stream_threads_are_gone():
    a = np.arange(640.0).reshape(64, 10)
    x = da.from_array(a, chunks=(16, 10))
    rt = dask_overlap.get_runtime("host")
    for stream in rt.streams:  # each thread ends as if it had died, the stream not closed
        stream._queue.put(_stop_of(stream))
        stream._thread.join(10)
        assert not stream._thread.is_alive()
    y = dask_overlap.map_blocks(np.negative, x, split_axis=0, sub_chunk_bytes=160)
    np.testing.assert_array_equal(y.compute(), -a)


def _stop_of(stream: Any) -> Any:
    """What ends a host stream's thread (without marking the stream closed)."""
    from dask_overlap.backends import host

    return host._STOP


@pytest.mark.timeout(60)
def test_a_callback_that_raises_fails_its_partition_instead_of_hanging(monkeypatch):
    from dask_overlap.pipeline import executors

    real = executors.ThreadedExecutor._post
    raised = []

    def post(self, event):
        if threading.current_thread() is not threading.main_thread() and not raised:
            raised.append(event)
            raise RuntimeError("a callback broke")
        real(self, event)

    monkeypatch.setattr(executors.ThreadedExecutor, "_post", post)
    x = da.from_array(np.arange(640.0).reshape(64, 10), chunks=(64, 10))
    y = dask_overlap.map_blocks(np.negative, x, split_axis=0, sub_chunk_bytes=160)
    with pytest.raises(RuntimeError, match="a callback broke"):
        y.compute(scheduler="sync")
    assert raised
    assert wait_until_idle()["partitions_active"] == 0


# == only on the GPU ===================================================================
# What the cases above check on the host, where the GPU's version differs: its own sizes,
# its device pool compared with a baseline, and what CuPy does otherwise than NumPy.


# -- 1. func raises in one sub-chunk (the host's threaded cases are in test_bad_input) ---
@pytest.mark.gpu
@pytest.mark.timeout(120)
@pytest.mark.parametrize("row", [1024, 1536, 2047], ids=["first", "middle", "last"])
@pytest.mark.parametrize("split_axis", [0, None])
def test_func_raises(cupy: Any, row: int, split_axis: int | None) -> None:
    device_before = warm()
    data = rows_data(3072, 256, np.float32)  # three 1 MiB partitions, 64 sub-chunks of 16 kB
    x = da.from_array(data, chunks=(1024, 256))
    kwargs = dict(split_axis=split_axis, sub_chunk_bytes=16 * 1024, dtype=x.dtype)
    with pytest.raises(Boom) as info:
        dask_overlap.map_blocks(failing_at(row), x, **kwargs).compute()
    assert type(info.value) is Boom and str(info.value) == f"row {row} is cursed"
    del info
    stats = settled("cuda", device_before)
    assert stats["partitions_failed"] == 1
    same_bits(dask_overlap.map_blocks(lambda b: b * 2, x, **kwargs).compute(), data * 2)
    settled("cuda", device_before)


# -- 2. KeyboardInterrupt in the threaded scheduler -------------------------------------
@pytest.mark.gpu
@pytest.mark.timeout(120)
@pytest.mark.usefixtures("ctrl_c")
def test_keyboard_interrupt(cupy: Any) -> None:
    device_before = warm()
    data = rows_data(3072, 256, np.float32)
    x = da.from_array(data, chunks=(1024, 256))
    y = dask_overlap.map_blocks(
        interrupt_at(1500, "interrupt_main"), x, split_axis=0, sub_chunk_bytes=16 * 1024
    )
    with dask.config.set(num_workers=3), pytest.raises(KeyboardInterrupt):
        y.compute()
    settled("cuda", device_before)
    same_bits(dask_overlap.map_blocks(lambda b: b + 1, x).compute(), data + 1)


# -- 4. pinned pool smaller than a sub-chunk, and than a partition -----------------------
@pytest.mark.gpu
@pytest.mark.timeout(120)
@pytest.mark.parametrize("pool", [0, 8 * 1024, 512 * 1024], ids=["none", "sub", "partition"])
def test_small_pinned_pool(cupy: Any, pool: int) -> None:
    data = np.arange(4096 * 256, dtype=np.int32).reshape(4096, 256)  # 1 MiB partitions
    x = da.from_array(data, chunks=(1024, 256))
    with dask.config.set({"overlap.pinned-pool-size": pool, "num_workers": 4}):
        dask_overlap.close_runtimes()
        y = dask_overlap.map_blocks(lambda b: b * 3 + 1, x, split_axis=0, sub_chunk_bytes=65536)
        z = dask_overlap.map_blocks(lambda b: b ^ 5, y, split_axis=0, sub_chunk_bytes=32768)
        same_bits(z.compute(), (data * 3 + 1) ^ 5)
    stats = wait_until_idle()
    assert stats["pinned_pool_size"] == pool
    assert stats["pinned_bytes_peak"] <= pool
    if pool < 2 * 65536:  # not one sub-chunk's way in and out fits: all of it falls back
        assert stats["pinned_fallbacks"] >= 2 * x.npartitions
    else:  # smaller than a partition: sub-chunks wait for ring room instead; the only
        # fallbacks are blocks RMM's fixed-size pool refused although the budget had room
        # (fragmented by the two stages' 64 and 32 KiB blocks side by side)
        assert stats["pinned_fallbacks"] == stats["pinned_refused"]
    assert stats["in_flight"] == 0


# -- 5. device memory exhausted by func, on a worker ------------------------------------
ASK = 2**46  # 64 TiB: more than any device pool


def greedy(b: Any) -> Any:
    if b.size and bool((b[:, 0] == 1100).any()):
        array_module("cuda").empty(ASK, dtype=np.uint8)
    return b + 1


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_device_out_of_memory_on_a_worker_leaves_it_usable(cupy: Any) -> None:
    data = rows_data(3072, 256, np.float32)
    x = da.from_array(data, chunks=(1024, 256))
    with (
        LocalCluster(n_workers=1, threads_per_worker=2, processes=True, **CLUSTER_KW) as cluster,
        Client(cluster) as client,
    ):
        register(client, "cuda")
        y = dask_overlap.map_blocks(greedy, x, split_axis=0, sub_chunk_bytes=65536)
        with pytest.raises(MemoryError, match=re.escape(f"{ASK:,} bytes")) as info:
            client.compute(y, sync=True)
        assert f"partition ('{y.name}', 1, 0)" in str(info.value)
        del info
        z = dask_overlap.map_blocks(lambda b: b + 1, x, split_axis=0)
        same_bits(client.compute(z, sync=True), data + 1)
        (stats,) = poll(
            lambda: (
                (s := client.run(runtime_stats))
                and all(v["partitions_active"] == 0 and v["in_flight"] == 0 for v in s.values())
                and list(s.values())
            )
        )
        assert stats["backend"] == "cuda" and stats["partitions_failed"] == 1


# -- 6. output dtype or shape other than declared ---------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("split_axis", [None, 0])
def test_output_other_than_declared(cupy: Any, split_axis: int | None) -> None:
    x = da.from_array(rows_data(2048, 256, np.float32), chunks=(1024, 256))
    y = dask_overlap.map_blocks(
        lambda b: b.astype(cupy.float64), x, dtype=np.float32, split_axis=split_axis
    )
    with pytest.raises(ValueError, match=re.escape(f"partition ('{y.name}', ")) as info:
        y.compute()
    assert "float64" in str(info.value) and "declares dtype float32" in str(info.value)
    del info
    y = dask_overlap.map_blocks(lambda b: b[:, :3], x, split_axis=split_axis)
    with pytest.raises(ValueError, match=re.escape("(1024, 256)")):
        y.compute()


# -- 7. odd inputs, against NumPy -------------------------------------------------------
CASES = {
    "empty": (np.ones((0, 64), np.float32), (16, 16)),
    "empty-chunks": (np.arange(600, dtype=np.int32).reshape(20, 30), ((8, 0, 12), (0, 30))),
    "fortran": (np.asfortranarray(np.arange(64 * 48, dtype=np.int64).reshape(64, 48)), (16, 24)),
    "big-endian": ((np.arange(40 * 30) - 300).astype(">i4").reshape(40, 30), (16, 10)),
    "big-endian-float": (np.arange(40 * 30, dtype=">f8").reshape(40, 30), (16, 10)),
    "uneven": (np.arange(3000 * 4, dtype=np.int32).reshape(3000, 4), ((1, 2990, 3, 6), (4,))),
}


@pytest.mark.gpu
@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("split_axis", [None, 0, 1])
def test_odd_inputs_match_numpy(cupy: Any, case: str, split_axis: int | None) -> None:
    a, chunks = CASES[case]
    x = da.from_array(a, chunks=chunks)
    y = dask_overlap.map_blocks(times_three, x, split_axis=split_axis, sub_chunk_bytes=64)
    expected = a * 3
    got = y.compute()
    assert y.dtype == got.dtype
    same_bits(got, expected)


@pytest.mark.gpu
def test_zero_d_inputs(cupy: Any) -> None:
    x = da.from_array(np.float32(2.5))
    same_bits(dask_overlap.map_blocks(times_three, x).compute(), np.float32(2.5) * 3)
    z = da.from_array(np.arange(12, dtype=np.float32).reshape(3, 4), chunks=(2, 2))
    y = dask_overlap.map_blocks(lambda u, v: u * v, z, x, split_axis=0, sub_chunk_bytes=8)
    same_bits(y.compute(), np.arange(12, dtype=np.float32).reshape(3, 4) * np.float32(2.5))


@pytest.mark.gpu
def test_big_endian_kept_is_a_clear_error(cupy: Any) -> None:
    """CuPy computes in native byte order: a func that keeps its input's dtype returns
    native values where Dask declared big-endian, which is said, not handed on."""
    a = np.arange(40, dtype=">f8").reshape(8, 5)
    y = dask_overlap.map_blocks(lambda b: b.copy(), da.from_array(a, chunks=(4, 5)))
    assert y.dtype == np.dtype(">f8")
    with pytest.raises(ValueError, match=re.escape("declares dtype >f8")):
        y.compute()


# -- 8. stress, in the threaded scheduler -----------------------------------------------
@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_stress_a_thousand_partitions_threaded(cupy: Any) -> None:
    device_before = warm()
    x, data, sub1, sub2 = stress_data("cuda", seed=8)
    with dask.config.set(num_workers=6):
        same_bits(stress_graph(x, sub1, sub2).compute(), ((data * 3 + 1) ^ 0x5A5A) - 7)
    stats = settled("cuda", device_before, timeout=60)
    assert stats["partitions"] == 1000 + 4  # the two stages fused, and the warm-up's
    assert stats["partitions_failed"] == 0
    assert stats["pinned_bytes_peak"] <= PLUGIN_OPTIONS["cuda"]["pinned_pool_size"]
