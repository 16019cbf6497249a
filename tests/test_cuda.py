"""The cuda backend on a real GPU (``pytest -m gpu``; skipped where no GPU is visible)."""

from __future__ import annotations

import functools
import gc
import os
import pickle
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import dask
import dask.array as da
import numpy as np
import pytest
from dask.base import tokenize
from dask.highlevelgraph import HighLevelGraph
from support import GPU_CONFIG, GPU_POOL, poll, require_gpu

import dask_overlap

cp = require_gpu()

from dask_overlap.backends import cuda_memory  # noqa: E402
from dask_overlap.backends.cuda import CudaBackend, _rows  # noqa: E402
from dask_overlap.backends.kernel_pickling import guard_kernel_pickling  # noqa: E402
from dask_overlap.pipeline.partition import PartitionSpec, run_partition  # noqa: E402

pytestmark = pytest.mark.gpu

POOL = GPU_POOL
HERE = os.path.dirname(__file__)


@pytest.fixture(autouse=True)
def cuda_config() -> Iterator[None]:
    with dask.config.set(GPU_CONFIG):
        yield


def runtime() -> Any:
    return dask_overlap.get_runtime("cuda")


def pinned_in_use_once_idle(timeout: float = 10.0) -> int:
    """Pinned bytes held once no partition runs and unreachable cycles are collected.

    After a failure Dask raises at once while other partitions may still run, and the
    threaded scheduler keeps finished results in a reference cycle until a collection.
    """
    deadline = time.monotonic() + timeout
    while True:
        gc.collect()
        stats = dask_overlap.runtime_stats("cuda")
        if stats["partitions_active"] == 0 and stats["pinned_bytes_in_use"] == 0:
            return 0
        if time.monotonic() > deadline:
            return stats["pinned_bytes_in_use"] or -1
        time.sleep(0.02)


def poison_pool() -> None:
    """Fill the free part of the pinned pool with 0xFF, so unwritten output shows."""
    pool = runtime().backend.pinned
    room = pool.reserve(pool.limit - pool.in_use)
    assert room is not None
    block = room.take(room.left)
    assert block is not None
    block[...] = 0xFF
    del block
    gc.collect()


def views(host: Any, rows: int) -> da.Array:
    """A dask array whose chunks are views of ``host`` (no copy, so pinned stays pinned)."""
    name = f"views-{tokenize(id(host), host.shape, host.strides)}"
    starts = range(0, host.shape[0], rows)
    rest = tuple((n,) for n in host.shape[1:])
    dsk = {(name, i) + (0,) * (host.ndim - 1): host[s : s + rows] for i, s in enumerate(starts)}
    chunks = (tuple(min(rows, host.shape[0] - s) for s in starts), *rest)
    graph = HighLevelGraph.from_collections(name, dsk, dependencies=())
    return da.Array(graph, name, chunks, meta=host[:0])


def affine(b: Any) -> Any:
    return b * 3 + 1


CASES = [
    # shape, chunk rows, split_axis
    ((512, 256), 128, 0),
    ((512, 256), 128, 1),  # sub-chunks are column slices: non-contiguous outputs
    ((64, 96, 80), 16, 1),
    ((64, 96, 80), 16, 2),
    ((512, 256), 100, None),
    ((1000,), 300, 0),
]


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int32, np.uint8, np.complex64])
@pytest.mark.parametrize("shape,rows,split_axis", CASES)
def test_matches_numpy(dtype: Any, shape: tuple, rows: int, split_axis: int | None) -> None:
    rng = np.random.default_rng(0)
    x = (rng.random(shape) * 100).astype(dtype)
    poison_pool()
    y = dask_overlap.map_blocks(affine, views(x, rows), split_axis=split_axis, sub_chunk_bytes=8192)
    np.testing.assert_array_equal(y.compute(), affine(x))
    stats = runtime().stats()
    assert stats["backend"] == "cuda"
    assert stats["bytes_h2d"] == x.nbytes and stats["bytes_d2h"] == x.nbytes


def test_pinned_input_is_not_staged() -> None:
    rt = runtime()
    block = rt.backend.pinned.allocate(4 * 2**20)
    x = block.view(np.float32).reshape(1024, 1024)
    x[...] = np.arange(x.size, dtype=np.float32).reshape(x.shape)
    assert rt.backend.is_pinned(x) and rt.backend.is_pinned(x[256:512])
    poison_pool()
    y = dask_overlap.map_blocks(affine, views(x, 256), split_axis=0, sub_chunk_bytes=2**18)
    got = y.compute()
    np.testing.assert_array_equal(got, affine(x))
    assert rt.stats()["bytes_staged"] == 0


def test_pageable_input_is_staged() -> None:
    x = np.arange(1024 * 1024, dtype=np.float32).reshape(1024, 1024)
    assert not runtime().backend.is_pinned(x)
    y = dask_overlap.map_blocks(affine, views(x, 256), split_axis=0, sub_chunk_bytes=2**18)
    np.testing.assert_array_equal(y.compute(), affine(x))
    assert runtime().stats()["bytes_staged"] == x.nbytes


@pytest.mark.parametrize("split_axis", [0, 1, None])
def test_non_contiguous_input(split_axis: int | None) -> None:
    base = np.arange(512 * 600, dtype=np.float64).reshape(512, 600)
    x = base[:, 10:522:2]  # strided rows and columns
    poison_pool()
    y = dask_overlap.map_blocks(affine, views(x, 128), split_axis=split_axis, sub_chunk_bytes=8192)
    np.testing.assert_array_equal(y.compute(), affine(x))


def test_cupy_input_skips_h2d() -> None:
    x = cp.arange(512 * 256, dtype=cp.float32).reshape(512, 256)
    y = dask_overlap.map_blocks(affine, da.from_array(x, chunks=(128, 256)), split_axis=0)
    np.testing.assert_array_equal(y.compute(), cp.asnumpy(affine(x)))
    stats = runtime().stats()
    assert stats["bytes_h2d"] == 0 and stats["bytes_d2h"] == x.nbytes


def test_result_types_and_zero_d() -> None:
    """0-d CuPy results, NumPy results and results of another dtype or layout."""
    rt = runtime()
    x = np.arange(4096, dtype=np.float32).reshape(64, 64)

    def spec(split: int | None) -> PartitionSpec:
        return PartitionSpec(("t", 0), (0,), 2, split, split, 4096, 2)

    got = run_partition(rt, lambda b: b.sum(), (x,), {}, spec(None))
    assert got.shape == () and got == x.sum()
    got = run_partition(rt, lambda b: cp.asnumpy(b) * 2, (x,), {}, spec(0))
    np.testing.assert_array_equal(got, x * 2)
    got = run_partition(rt, lambda b: b.T.astype(cp.float64).T, (x,), {}, spec(1))
    np.testing.assert_array_equal(got, x.astype(np.float64))
    with pytest.raises(TypeError, match="must return an array"):
        run_partition(rt, lambda b: 3, (x,), {}, spec(None))


def test_copy_out_into_odd_layouts() -> None:
    """Straight into strided pinned and pageable outputs, and an irregular layout."""
    rt = runtime()
    backend, stream = rt.backend, rt.streams[0]
    src = cp.arange(6 * 8 * 10, dtype=cp.int32).reshape(6, 8, 10)
    ref = cp.asnumpy(src)
    block = backend.pinned.allocate(6 * 20 * 10 * 4)
    pinned = block.view(np.int32).reshape(6, 20, 10)
    pageable = np.full((6, 20, 10), -1, np.int32)
    for out in (pinned[:, 4:12], pageable[:, 4:12], pageable[:, 4:12][:, :, ::-1].T.T):
        out[...] = -1
        assert out.flags.c_contiguous is False

        def work(out: np.ndarray = out) -> None:
            backend.copy_out(stream, src, out)

        errors: list[Any] = []
        stream.submit(work, lambda r, e, errors=errors: errors.append(e))
        stream.synchronize()
        assert errors == [None]
        np.testing.assert_array_equal(out, ref)
    assert _rows(pageable[:, 4:12]) == (6, 8 * 10 * 4, 20 * 10 * 4)
    assert _rows(pageable[:, :, ::-1]) is None


def test_pool_bounded_and_empty_after_run() -> None:
    x = np.ones((4096, 1024), np.float32)  # 16 MiB, outputs 16 MiB, pool 64 MiB
    y = dask_overlap.map_blocks(affine, views(x, 512), split_axis=0, sub_chunk_bytes=2**20)
    np.testing.assert_array_equal(y.compute(), affine(x))
    stats = runtime().stats()
    assert 0 < stats["pinned_bytes_peak"] <= POOL
    del y
    gc.collect()
    assert runtime().stats()["pinned_bytes_in_use"] == 0


def test_pool_empty_after_func_raises() -> None:
    x = np.ones((4096, 256), np.float32)

    def bad(b: Any) -> Any:
        if float(b[0, 0]) > 2000:
            raise ValueError("boom")
        return b + 1

    x[:, 0] = np.arange(4096)
    y = dask_overlap.map_blocks(bad, views(x, 1024), split_axis=0, sub_chunk_bytes=2**16)
    with pytest.raises(ValueError, match="boom"):
        y.compute()
    assert pinned_in_use_once_idle() == 0
    assert runtime().stats()["partitions_failed"] >= 1


def test_pool_smaller_than_the_result_waits_instead_of_falling_back() -> None:
    with dask.config.set({"overlap.pinned-pool-size": "1MiB", "num_workers": 4}):
        dask_overlap.close_runtimes()
        x = np.arange(8192 * 256, dtype=np.float32).reshape(8192, 256)  # 8 MiB
        y = dask_overlap.map_blocks(affine, views(x, 1024), split_axis=0, sub_chunk_bytes=2**17)
        np.testing.assert_array_equal(y.compute(), affine(x))
        stats = runtime().stats()
        assert stats["pinned_fallbacks"] == 0 and stats["pinned_bytes_peak"] <= 2**20
        assert stats["bytes_staged"] == stats["bytes_unstaged"] == x.nbytes


def test_pool_smaller_than_a_sub_chunk_falls_back() -> None:
    with dask.config.set({"overlap.pinned-pool-size": "1MiB"}):
        dask_overlap.close_runtimes()
        x = np.arange(2048 * 256, dtype=np.float32).reshape(2048, 256)  # 2 MiB
        y = dask_overlap.map_blocks(affine, views(x, 1024), split_axis=0, sub_chunk_bytes=2**19)
        np.testing.assert_array_equal(y.compute(), affine(x))
        stats = runtime().stats()
        assert stats["pinned_fallbacks"] > 0 and stats["pinned_bytes_peak"] <= 2**20


def test_200_partitions_no_growth() -> None:
    x = np.arange(200 * 64 * 256, dtype=np.float32).reshape(200 * 64, 256)
    func = dask_overlap.map_blocks
    rt = runtime()
    # warm: pools, kernels and CuPy's caches
    np.testing.assert_array_equal(
        func(affine, views(x[:640], 64), split_axis=0).compute(), affine(x[:640])
    )
    gc.collect()
    rt.backend.trim()  # the scratch cache's blocks back to the device pool
    pinned0, device0 = rt.stats()["pinned_bytes_in_use"], rt.backend.device_bytes_in_use()
    reserved0 = rt.backend.pinned.reserved()
    for _ in range(2):
        y = func(affine, views(x, 64), split_axis=0, sub_chunk_bytes=2**14)
        assert y.numblocks[0] == 200
        np.testing.assert_array_equal(y.compute(), affine(x))
        del y
        gc.collect()
    stats = rt.stats()
    assert stats["pinned_bytes_in_use"] == pinned0 == 0
    # What the scratch cache kept goes back once the runtime has been idle a while.
    poll(lambda: rt.backend.device_bytes_in_use() <= device0, 10, "the device back to its baseline")
    assert rt.backend.pinned.reserved() == reserved0
    assert stats["in_flight"] == 0 and stats["device_bytes_in_flight"] == 0


def _cached_bytes_seen(rt: Any, out: str) -> list[int]:
    """The scratch cache's bytes in use, as ``func`` sees them, per partition."""
    cache = cuda_memory._scratch_caches.items[rt.backend.device_id]
    seen: list[int] = []

    def func(b: Any) -> Any:
        if isinstance(b, cp.ndarray) and b.size:  # (not a call that infers the dtype)
            seen.append(cache.used_bytes())
        return b * 2 + 1

    x = np.arange(8 * 1024 * 256, dtype=np.float32).reshape(8 * 1024, 256)
    y = dask_overlap.map_blocks(func, views(x, 1024), dtype=x.dtype, out=out)
    got = y.compute(scheduler="threads", num_workers=4)
    np.testing.assert_array_equal(cp.asnumpy(got) if out == "device" else got, x * 2 + 1)
    return seen


def test_scratch_cache_serves_a_partition_and_empties_when_idle() -> None:
    rt = runtime()
    seen = _cached_bytes_seen(rt, "host")
    # Each partition's device input (1 MiB) came from the cache.
    assert len(seen) == 8 and min(seen) >= 2**20
    cache = cuda_memory._scratch_caches.items[rt.backend.device_id]
    poll(lambda: cache.total_bytes() == 0, 10, "the scratch cache emptied once idle")


def test_results_left_on_the_device_do_not_come_from_the_scratch_cache() -> None:
    rt = runtime()
    rt.backend.trim()
    seen = _cached_bytes_seen(rt, "device")
    assert seen == [0] * 8


def test_completion_only_after_copy_lands() -> None:
    """on_complete fires after the D2H has landed, even behind a long kernel."""
    rt = runtime()
    backend, stream = rt.backend, rt.streams[1]
    block = backend.pinned.allocate(2**24)
    out = block.view(np.float32)
    out[...] = -1
    seen: list[float] = []
    done = threading.Event()

    def work() -> None:
        a = cp.ones(2**22, cp.float32)
        for _ in range(200):
            a = a * 1.0 + 0.0
        backend.copy_out(stream, a, out)

    stream.submit(work, lambda r, e: None)
    stream.on_complete(lambda error: (seen.append((float(out[-1]), error)), done.set()))
    assert done.wait(30)
    assert seen == [(1.0, None)]


@pytest.mark.parametrize("split_axis", [None, 0, 1])
def test_out_device_keeps_cupy_chunks(split_axis: int | None) -> None:
    a = np.arange(96 * 80, dtype=np.float32).reshape(96, 80)
    x = da.from_array(a, chunks=(32, 40))
    y = dask_overlap.map_blocks(
        lambda b: b * 2 + 1, x, split_axis=split_axis, sub_chunk_bytes=1024, out="device"
    )
    assert isinstance(y._meta, cp.ndarray)
    blocks = dask.compute(*y.to_delayed().ravel())
    assert len(blocks) == y.npartitions and all(isinstance(b, cp.ndarray) for b in blocks)
    got = y.compute()
    assert isinstance(got, cp.ndarray)
    np.testing.assert_array_equal(cp.asnumpy(got), a * 2 + 1)
    stats = dask_overlap.runtime_stats()
    assert stats["bytes_d2h"] == 0 and stats["pinned_fallbacks"] == 0


def test_streams_outlive_runtimes() -> None:
    """A closed runtime gives its streams back for the next one: none is destroyed."""
    first = {s.ptr for s in runtime().streams}
    dask_overlap.close_runtimes()
    assert {s.ptr for s in runtime().streams} == first


def test_device_results_in_cycles_outlive_their_runtime() -> None:
    """Device arrays allocated on a runtime's streams, held only by reference cycles and
    collected after the runtime closed, are freed on a stream that still exists (a
    collector that cleared the stream's wrapper first would otherwise destroy it)."""
    x = da.from_array(np.arange(64 * 256, dtype=np.float32).reshape(64, 256), chunks=(16, 256))
    for _ in range(20):
        y = dask_overlap.map_blocks(lambda b: b * 2, x, out="device")
        arrays = dask.compute(*y.to_delayed().ravel())
        cycle: list[Any] = list(arrays)
        cycle.append(cycle)
        del arrays, cycle
        dask_overlap.close_runtimes()
        gc.collect()
    same = dask_overlap.map_blocks(lambda b: b * 2, x).compute()
    np.testing.assert_array_equal(same, np.arange(64 * 256, dtype=np.float32).reshape(64, 256) * 2)


def test_naive_matches() -> None:
    rt = runtime()
    x = np.arange(1000, dtype=np.float32)
    np.testing.assert_array_equal(rt.backend.naive(affine, x), affine(x))


def test_auto_picks_cuda() -> None:
    from dask_overlap.backends import resolve_backend

    assert resolve_backend("auto") == "cuda"
    assert isinstance(runtime().backend, CudaBackend)


def test_guard_pickles_kernels_by_reference() -> None:
    guard_kernel_pickling()
    k = cp.ElementwiseKernel("T x", "T y", "y = x + 1", "plus_one_by_ref")
    assert pickle.loads(pickle.dumps(k)) is k
    # RawKernel keeps CuPy's own pickling (source, recompiled), which can cross processes.
    raw = cp.RawKernel('extern "C" __global__ void nop() {}', "nop")
    assert pickle.loads(pickle.dumps(raw)) is not raw
    # A ufunc that ran (its compiled module in its memo) pickles by name: the same object.
    np.testing.assert_array_equal(cp.asnumpy(cp.negative(cp.arange(3.0))), [-0.0, -1, -2])
    assert b"negative" in pickle.dumps(cp.negative)
    assert pickle.loads(pickle.dumps(cp.negative)) is cp.negative


@pytest.mark.parametrize("kind", ["elementwise", "reduction", "raw", "ufunc"])
def test_main_module_kernel_trap(kind: str) -> None:
    """A func closing over a kernel defined in __main__ works inside Dask tasks, and so
    does a CuPy ufunc given as func after it ran in the client (``ufunc``: this crashed
    the process in Dask's tokenize, on an H100)."""
    script = os.path.join(HERE, "cuda_trap_script.py")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    proc = subprocess.run(
        [sys.executable, script, "overlap", kind],
        capture_output=True,
        text=True,
        env=env,
        timeout=240,
    )
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stdout + proc.stderr
    assert "INVALID_HANDLE" not in proc.stderr and "moduleUnload" not in proc.stderr, proc.stderr


# -- small partitions: the direct path (no ring) and the lean path ----------------------
DIRECT = {"overlap.direct-bytes": "1MiB"}


@pytest.mark.parametrize("out", ["host", "pinned", "device"])
@pytest.mark.parametrize(
    "make",
    [
        lambda: np.arange(96 * 256, dtype=np.float32).reshape(96, 256),
        lambda: np.asfortranarray(np.arange(96 * 256, dtype=np.float64).reshape(96, 256)),
        lambda: np.arange(96 * 600, dtype=np.int32).reshape(96, 600)[:, 5:505:2],
        lambda: np.arange(96 * 256, dtype=">f4").reshape(96, 256),
    ],
    ids=["c-order", "f-order", "strided", "big-endian"],
)
def test_small_partitions_skip_the_ring(make: Any, out: str) -> None:
    """Partitions whose copies are under direct-bytes go straight from their input to the
    device and straight back into their result, in any layout, to any ``out``."""
    x = make()
    with dask.config.set(DIRECT):  # the runtime of these settings (see process_runtime)
        y = dask_overlap.map_blocks(affine, da.from_array(x, chunks=(32, -1)), out=out)
        got = y.compute()
        stats = runtime().stats()
    expected = affine(x.astype(x.dtype.newbyteorder("=")))
    np.testing.assert_array_equal(cp.asnumpy(got) if out == "device" else got, expected)
    assert stats["partitions"] == stats["sub_chunks"] == 3
    assert stats["bytes_h2d"] == x.nbytes
    if out != "device":
        assert stats["bytes_d2h"] == expected.nbytes
    if out != "pinned":
        assert stats["pinned_bytes_peak"] == 0  # no ring
    assert stats["bytes_staged"] == stats["bytes_unstaged"] == 0
    assert stats["pinned_fallbacks"] == 0


def test_many_small_partitions_on_many_threads_reuse_their_events() -> None:
    """400 small partitions on 8 threads: right results, nothing held afterwards, and the
    timing events come back for reuse instead of piling up."""
    x = np.random.default_rng(5).standard_normal((400 * 64, 128)).astype(np.float32)
    with dask.config.set({**DIRECT, "num_workers": 8}):
        rt = runtime()
        y = dask_overlap.map_blocks(affine, da.from_array(x, chunks=(64, 128)))
        np.testing.assert_array_equal(y.compute(), affine(x))
    stats = rt.stats()
    assert stats["partitions"] == 400 and stats["partitions_failed"] == 0
    assert stats["in_flight"] == stats["device_bytes_in_flight"] == 0
    assert stats["pinned_bytes_in_use"] == 0
    assert 0 < len(rt.backend._marks) <= 4 * 8 * 2  # reused: about one set per thread
    assert len(rt.timeline) >= 3 * 400 or len(rt.timeline) == rt.timeline.maxlen


def test_small_partitions_are_timed_now_and_then_and_all_reach_the_timeline(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The lean path times a small partition's stages on the device only now and then
    (its marks are driver calls): here the first ones, before any was learned. Every
    partition still has its three spans on the timeline, bytes and busy seconds."""
    from dask_overlap.pipeline import sampling

    monkeypatch.setattr(sampling, "SAMPLE_SECONDS", 3600.0)
    x = np.random.default_rng(6).standard_normal((200 * 64, 128)).astype(np.float32)
    with dask.config.set({**DIRECT, "num_workers": 4}):
        rt = runtime()
        assert rt.sampler is not None
        marks: list[int] = []
        mark = rt.backend.mark
        monkeypatch.setattr(rt.backend, "mark", lambda s: marks.append(1) or mark(s))
        y = dask_overlap.map_blocks(affine, da.from_array(x, chunks=(64, 128)))
        np.testing.assert_array_equal(y.compute(), affine(x))
    timed = len(marks) // 4
    assert 1 <= timed <= 8  # those that started before the first was learned, 4 at a time
    spans = [s for s in rt.timeline if s.key[0] == y.name]
    assert len(spans) == 3 * 200
    assert all(s.end >= s.start for s in spans)
    assert sum(s.nbytes for s in spans if s.stage == "h2d") == x.nbytes
    stats = rt.stats()
    assert stats["bytes_h2d"] == stats["bytes_d2h"] == x.nbytes
    assert stats["sub_chunks_estimated"] == 200 - timed
    assert all(stats["busy_seconds"][k] > 0 for k in ("h2d", "compute", "d2h"))


@pytest.mark.parametrize(
    "source, axis, sub_rows",
    [
        ("pageable", 0, None),
        ("views", 0, None),  # pageable slices of one array: already one array
        ("pinned", 0, None),
        ("pool", 0, None),
        ("pool", 0, 100),  # sub-chunks straddling the pinned blocks
        ("pool", 1, 24),  # the blocks' parts are rows of the join: 2-D copies
        ("device", 0, None),
    ],
)
def test_batched_blocks_are_joined_once_and_copied_in_directly(
    source: str, axis: int, sub_rows: int | None
) -> None:
    """batch=4 on the GPU: pageable blocks are joined into one pinned-pool block (the only
    host copy: counted as staged, nothing else staged or fallen back); pinned blocks of
    their own (the pool's, from out="pinned") are not joined on the host but copied to the
    device one by one, straight into their places; slices of one array (pageable or a
    pinned array's) are one view already, copied in as any input; device blocks are joined
    on the device. The results are right whatever the blocks were."""
    import cupyx

    a = np.random.default_rng(7).standard_normal((40 * 64, 40 * 8)).astype(np.float32)
    x = da.from_array(a, chunks=(64, a.shape[1]) if axis == 0 else (a.shape[0], 8))
    if source == "pageable":  # blocks of their own (made first: fused, "+ 0" would read a's)
        x = (x + 0).persist()
    if source == "views":  # slices of one array (from_array's blocks may be copies)
        x = views(a, 64)
    if source == "pinned":  # a pinned array's row blocks (from_array would copy them)
        host = cupyx.empty_pinned(a.shape, a.dtype)
        host[...] = a
        x = views(host, 64)
    if source in ("pool", "device"):
        out = "pinned" if source == "pool" else "device"
        (x,) = dask.persist(dask_overlap.map_blocks(lambda b: b + 0, x, out=out))
    before = runtime().stats()
    row = a.nbytes // a.shape[axis]
    sub = "auto" if sub_rows is None else sub_rows * row
    y = dask_overlap.map_blocks(affine, x, split_axis=axis, batch=4, sub_chunk_bytes=sub)
    assert y.numblocks == ((10, 1) if axis == 0 else (1, 10))
    np.testing.assert_array_equal(y.compute(), affine(np.asarray(a)))
    after = runtime().stats()
    moved = {k: after[k] - before[k] for k in ("partitions", "bytes_staged", "bytes_h2d")}
    # Pageable bytes are staged once: joined into the pool when the blocks are their own;
    # a view of one array is not joined but staged by the partition, as any input.
    staged = a.nbytes if source in ("pageable", "views") else 0
    h2d = 0 if source == "device" else a.nbytes  # device blocks: joined on the device
    assert moved == {"partitions": 10, "bytes_staged": staged, "bytes_h2d": h2d}
    if sub_rows is not None:
        assert after["sub_chunks"] - before["sub_chunks"] > 10
    assert after["partitions_failed"] == 0 and after["pinned_fallbacks"] == 0


@pytest.mark.parametrize("source", ["pinned", "pool", "device"])
def test_small_blocks_are_batched_by_default_and_cut_back(
    source: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The default batch="auto" on the GPU: 64 pinned (a pinned array's or the pool's) or
    device blocks of 80 KiB run as 8 partitions of 8 (the joins as in the test above), and
    the output is cut back into 64 blocks, views of their partition's result."""
    import cupyx

    import dask_overlap.graph.batch

    monkeypatch.setattr(dask_overlap.graph.batch, "AUTO_MIN_BYTES", 8 * 64 * 320 * 4)
    a = np.random.default_rng(8).standard_normal((64 * 64, 320)).astype(np.float32)
    host = cupyx.empty_pinned(a.shape, a.dtype)
    host[...] = a
    x = views(host, 64)
    if source != "pinned":
        out = "pinned" if source == "pool" else "device"
        (x,) = dask.persist(dask_overlap.map_blocks(lambda b: b + 0, x, out=out))
    before = runtime().stats()
    y = dask_overlap.map_blocks(affine, x, split_axis=0, out="device")
    assert y.chunks == x.chunks
    (done,) = dask.persist(y)
    graph = done.__dask_graph__()
    blocks = [graph[k] for k in dask.core.flatten(done.__dask_keys__())]
    assert len(blocks) == 64 and all(isinstance(b, cp.ndarray) for b in blocks)
    assert len({b.base.data.ptr for b in blocks}) == 8  # views of 8 partitions' results
    np.testing.assert_array_equal(cp.asnumpy(cp.concatenate(blocks)), affine(a))
    after = runtime().stats()
    moved = {k: after[k] - before[k] for k in ("partitions", "bytes_staged", "bytes_h2d")}
    h2d = 0 if source == "device" else a.nbytes
    assert moved == {"partitions": 8, "bytes_staged": 0, "bytes_h2d": h2d}
    assert after["partitions_failed"] == 0


def test_device_slices_of_one_array_are_joined_without_a_copy() -> None:
    from dask_overlap.pipeline.pieces import Pieces, join

    owner = cp.arange(64 * 8, dtype=cp.float32).reshape(64, 8)
    joined, copied = join(
        runtime(), Pieces(0, tuple(owner[i : i + 16] for i in range(16, 64, 16))), "p"
    )
    assert copied == 0 and joined.shape == (48, 8)
    assert joined.data.ptr == owner[16:].data.ptr
    cp.testing.assert_array_equal(joined, owner[16:])
    apart, _ = join(runtime(), Pieces(0, (owner[0:16], owner[32:48])), "p")
    assert apart.data.ptr != owner.data.ptr
    cp.testing.assert_array_equal(apart, cp.concatenate([owner[0:16], owner[32:48]]))


# -- what func may do with its input ------------------------------------------------------
@pytest.mark.parametrize("threads", [1, 4])
def test_a_func_that_returns_or_keeps_its_input_keeps_it_intact(threads: int) -> None:
    """A func that returns its device input (out="device") or keeps it sees every block's
    own values afterwards: no later partition writes into memory a block still refers to
    (the guard against reusing input memory per stream, tried for issue 12)."""
    x = np.arange(64 * 64 * 40, dtype=np.float32).reshape(64 * 40, 64)
    kept: list[Any] = []

    def keep(b: Any) -> Any:
        kept.append(b)
        return b * 2

    with dask.config.set({"num_workers": threads, "overlap.streams": 2}):
        same = dask_overlap.map_blocks(lambda b: b, views(x, 64), out="device").persist()
        np.testing.assert_array_equal(cp.asnumpy(same.compute()), x)
        doubled = dask_overlap.map_blocks(keep, views(x, 64)).compute()
    np.testing.assert_array_equal(doubled, x * 2)
    blocks = [b for b in kept if b.shape == (64, 64)]  # not dtype inference's calls
    assert len(blocks) == 40
    got = sorted((cp.asnumpy(b) for b in blocks), key=lambda b: float(b[0, 0]))
    for i, g in enumerate(got):
        np.testing.assert_array_equal(g, x[i * 64 : (i + 1) * 64])


# -- issue 13: what func may do and return -----------------------------------------------
@pytest.mark.parametrize("split_axis", [None, 0])
def test_out_device_blocks_are_cupy_even_when_func_returns_numpy(split_axis: int | None) -> None:
    x = np.arange(64 * 32, dtype=np.float32).reshape(64, 32)
    y = dask_overlap.map_blocks(
        lambda b: cp.asnumpy(b) * 2, views(x, 16), split_axis=split_axis, out="device"
    )
    assert isinstance(y._meta, cp.ndarray)
    (done,) = dask.persist(y)
    blocks = [done.__dask_graph__()[k] for k in dask.core.flatten(done.__dask_keys__())]
    assert all(isinstance(b, cp.ndarray) for b in blocks)
    np.testing.assert_array_equal(cp.asnumpy(done.compute()), x * 2)


def test_dtype_inferred_for_a_func_that_only_takes_cupy() -> None:
    """cupyx.scipy refuses NumPy blocks: inference retries on CuPy blocks."""
    from cupyx.scipy import ndimage

    x = np.random.default_rng(2).standard_normal((64, 64)).astype(np.float32)
    y = dask_overlap.map_blocks(lambda b: ndimage.uniform_filter(b, 3), views(x, 16))
    assert y.dtype == np.float32
    expected = np.concatenate(
        [cp.asnumpy(ndimage.uniform_filter(cp.asarray(x[i : i + 16]), 3)) for i in range(0, 64, 16)]
    )
    np.testing.assert_allclose(y.compute(), expected, rtol=1e-6)


@functools.cache
def _slow_on_legacy() -> Any:
    return cp.ElementwiseKernel(
        "float32 x, int32 n",
        "float32 y",
        "float v = x; for (int k = 0; k < n; ++k) { v = v * 0.5f + x * 0.5f; } y = v * 2 + 1;",
        "dask_overlap_test_slow_legacy",
    )


def legacy_affine(b: Any) -> Any:
    """``affine`` computed by a long kernel on the legacy default stream, as a library
    that ignores CuPy's current stream would (after its input, as CuPy code that changes
    streams must)."""
    ready = cp.cuda.get_current_stream().record()
    cp.cuda.Stream.null.wait_event(ready)
    with cp.cuda.Stream.null:
        out = cp.empty_like(b)
        _slow_on_legacy()(b, np.int32(20000), out)
    return out


@pytest.mark.parametrize("split_axis", [None, 0])
def test_work_on_the_legacy_default_stream_is_ordered(split_axis: int | None) -> None:
    """The copy back waits for it (#13 item 1)."""
    x = np.random.default_rng(3).standard_normal((4096, 256)).astype(np.float32)
    with dask.config.set({"num_workers": 4}):
        y = dask_overlap.map_blocks(legacy_affine, views(x, 512), split_axis=split_axis)
        for _ in range(3):
            np.testing.assert_array_equal(y.compute(), x * 2 + 1)


RESOURCE_SET_BEFORE = """
import dask, dask.array as da, numpy as np, rmm, dask_overlap
mine = rmm.mr.PoolMemoryResource(rmm.mr.CudaMemoryResource(), initial_pool_size=2**28)
rmm.mr.set_current_device_resource(mine)
dask.config.set({"overlap.backend": "cuda"})
x = da.ones((2048, 1024), chunks=(256, 1024), dtype="f4")
got = dask_overlap.map_blocks(lambda b: b * 2, x, split_axis=0).compute()
assert (got == 2).all()
assert rmm.mr.get_current_device_resource() is mine, "the user's resource was replaced"
print("kept", type(rmm.mr.get_current_device_resource()).__name__)
"""


def test_an_rmm_resource_set_before_is_used_not_replaced() -> None:
    """#13 item 13: beside dask-cuda's RMMSetup or a user's own pool, no second pool."""
    done = subprocess.run(
        [sys.executable, "-c", RESOURCE_SET_BEFORE], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "kept PoolMemoryResource" in done.stdout


def test_a_fragmented_pinned_pool_refuses_without_an_error_on_stderr(capfd) -> None:
    """A request the pool's budget lets through but that no free run of the RMM pool fits
    (two 16 MiB holes, 32 MiB asked): RMM logs its failed growth as an error, the library
    refuses quietly (``None``, counted) and leaves RMM's log level as it was."""
    import rmm

    level = rmm.get_logging_level()
    device = runtime().backend.device_id
    pool = cuda_memory.PinnedPool(64 * 2**20, device)
    mib16 = 16 * 2**20
    with cp.cuda.Device(device):
        ptrs = [pool.mr.allocate(mib16, pool._stream) for _ in range(4)]
        for p in (ptrs[0], ptrs[2]):
            pool.mr.deallocate(p, mib16, pool._stream)
        capfd.readouterr()
        with pytest.raises(Exception, match="(?i)maximum pool size"):  # RMM itself: logged
            pool.mr.allocate(2 * mib16, pool._stream)
        rmm.flush_logger()
        assert "maximum pool size exceeded" in capfd.readouterr().err
        assert pool.allocate(2 * mib16) is None
        rmm.flush_logger()
        err = capfd.readouterr().err
        assert pool.refused == 1 and pool.in_use == 0
        assert "maximum pool size exceeded" not in err and "[error" not in err
        assert rmm.get_logging_level() == level
        for p in (ptrs[1], ptrs[3]):
            pool.mr.deallocate(p, mib16, pool._stream)
    # Room again (the holes joined): served.
    block = pool.allocate(2 * mib16)
    assert block is not None and block.nbytes == 2 * mib16
