"""``overlap.result-pool-size``: results made over buffers of results Dask let go."""

from __future__ import annotations

import gc
import threading

import dask
import dask.array as da
import numpy as np
import pytest
from support import GPU_CONFIG, poll, require_gpu

import dask_overlap
from dask_overlap import OverlapPlugin
from dask_overlap.pipeline.recycle import (
    AUTO_POOL_BYTES,
    AUTO_POOL_SHARE,
    MIN_RECYCLED_BYTES,
    ResultPool,
)

MiB = 1 << 20


def test_a_buffer_comes_back_only_when_its_last_view_goes() -> None:
    pool = ResultPool(8 * MiB)
    a = pool.empty((256, 1024), np.float32)  # 1 MiB
    a[:] = 3.0
    view = a[10:20, ::2]
    del a
    gc.collect()
    assert pool.idle_bytes == 0  # the view still uses the buffer
    assert float(view.sum()) == 3.0 * view.size
    del view
    assert pool.idle_bytes == MiB
    b = pool.empty((1024, 256), np.float32)  # the same bytes, another shape
    assert (pool.reused, pool.fresh, pool.idle_bytes) == (1, 1, 0)
    assert b.shape == (1024, 256) and b.dtype == np.float32 and b.flags.writeable
    assert b.flags.c_contiguous


def test_idle_buffers_never_exceed_the_capacity_oldest_freed_first() -> None:
    pool = ResultPool(3 * MiB)
    held = [pool.empty((MiB,), np.uint8) for _ in range(5)]
    where = [h.__array_interface__["data"][0] for h in held]
    for i in range(5):  # given back in order: the first two are freed
        held[i] = None
    assert pool.idle_bytes == 3 * MiB
    again = [pool.empty((MiB,), np.uint8) for _ in range(3)]
    assert pool.reused == 3 and pool.idle_bytes == 0
    assert {a.__array_interface__["data"][0] for a in again} == set(where[2:])
    pool.clear()
    assert pool.idle_bytes == 0
    pool.close()  # its runtime closed: buffers given back from now on are freed
    del again
    assert pool.idle_bytes == 0 and not pool._order


def test_small_oversized_and_object_results_are_plain_arrays() -> None:
    pool = ResultPool(4 * MiB)
    for shape, dtype in [((16,), np.float64), ((8 * MiB,), np.uint8), ((MiB,), object)]:
        a = pool.empty(shape, dtype)
        assert a.flags.owndata and a.shape == shape
    assert (pool.reused, pool.fresh) == (0, 0)
    assert MIN_RECYCLED_BYTES <= 4 * MiB


def test_buffers_come_back_from_other_threads() -> None:
    pool = ResultPool(64 * MiB)
    arrays = [pool.empty((MiB // 8,), np.float64) for _ in range(8)]
    threads = [threading.Thread(target=arrays.pop) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert pool.idle_bytes == 8 * MiB
    again = [pool.empty((MiB // 8,), np.float64) for _ in range(8)]
    assert pool.reused == 8 and pool.idle_bytes == 0
    del again


def _results(rows: int = 2048, cols: int = 512) -> tuple[np.ndarray, da.Array]:
    a = np.arange(rows * cols, dtype=np.float32).reshape(rows, cols)
    return a, da.from_array(a, chunks=(rows // 4, cols))


@pytest.mark.usefixtures("ring_only")
def test_a_runtime_makes_results_over_the_buffers_of_results_let_go() -> None:
    a, x = _results()  # four partitions of 1 MiB, each cut in two: outputs of their own
    with dask.config.set({"overlap.result-pool-size": "8MiB", "overlap.backend": "host"}):
        y = dask_overlap.map_blocks(np.negative, x, split_axis=0, sub_chunk_bytes=MiB // 2)
        first = y.compute()
        rt = dask_overlap.get_runtime("host")
        assert rt.results.capacity == 8 * MiB
        np.testing.assert_array_equal(first, -a)
        assert rt.results.fresh == 4
        assert rt.results.idle_bytes == 4 * MiB  # Dask let the four blocks go
        stats = dask_overlap.runtime_stats("host")
        assert (stats["result_bytes_idle"], stats["result_pool_size"]) == (4 * MiB, 8 * MiB)
        assert (stats["results_fresh"], stats["results_reused"]) == (4, 0)
        (done,) = dask.persist(y)
        assert rt.results.reused == 4 and rt.results.idle_bytes == 0
        np.testing.assert_array_equal(done.compute(), -a)
        del done
        for _ in range(5):  # a long run: the pool holds at most its capacity
            np.testing.assert_array_equal(y.compute(), -a)
            assert rt.results.idle_bytes <= rt.results.capacity
        assert rt.results.fresh == 4
        kept = y.compute()
        dask_overlap.close_runtimes()  # a result alive keeps its memory; none is kept after
        np.testing.assert_array_equal(kept, -a)
        del kept
        assert rt.results.closed and rt.results.idle_bytes == 0


@pytest.mark.usefixtures("ring_only")
def test_auto_by_default_zero_turns_it_off_and_a_bad_size_names_the_setting() -> None:
    from distributed.system import MEMORY_LIMIT

    a, x = _results()
    y = dask_overlap.map_blocks(np.negative, x, split_axis=0, sub_chunk_bytes=MiB // 2)
    np.testing.assert_array_equal(y.compute(), -a)
    rt = dask_overlap.get_runtime("host")
    assert rt.results.capacity == min(AUTO_POOL_BYTES, MEMORY_LIMIT // AUTO_POOL_SHARE) > 0
    assert rt.results.fresh == 4 and rt.results.idle_bytes == 4 * MiB
    with dask.config.set({"overlap.result-pool-size": 0}):
        np.testing.assert_array_equal(y.compute(), -a)
        rt = dask_overlap.get_runtime("host")
        assert rt.results.capacity == 0 and (rt.results.fresh, rt.results.idle_bytes) == (0, 0)
    with dask.config.set({"overlap.result-pool-size": "lots"}):
        with pytest.raises(ValueError, match="result_pool_size"):
            dask_overlap.get_runtime("host")


@pytest.mark.usefixtures("ring_only")
def test_idle_buffers_are_freed_once_the_runtime_has_been_idle_a_while(monkeypatch) -> None:
    from dask_overlap.pipeline import runtime as runtime_module

    monkeypatch.setattr(runtime_module, "RESULTS_IDLE_SECONDS", 1.0)
    a, x = _results()
    with dask.config.set({"overlap.result-pool-size": "8MiB"}):
        y = dask_overlap.map_blocks(np.negative, x, split_axis=0, sub_chunk_bytes=MiB // 2)
        np.testing.assert_array_equal(y.compute(), -a)
        rt = dask_overlap.get_runtime("host")
        assert rt.results.fresh == 4
        poll(lambda: rt.results.idle_bytes == 0, what="the idle buffers freed")
        np.testing.assert_array_equal(y.compute(), -a)  # fresh memory again, pooled again
        assert (rt.results.fresh, rt.results.reused) == (8, 0)


def test_a_worker_keeps_an_eighth_of_its_memory_limit_at_most() -> None:
    from distributed import Client, LocalCluster

    with (
        LocalCluster(
            n_workers=1, processes=False, memory_limit="1GiB", dashboard_address=None
        ) as cluster,
        Client(cluster) as client,
    ):
        client.register_plugin(OverlapPlugin(backend="host"))

        def capacity(dask_worker):
            return dask_worker.plugins["overlap"].runtime(dask_worker).results.capacity

        (got,) = client.run(capacity).values()
    assert got == (1 << 30) // AUTO_POOL_SHARE


@pytest.mark.gpu
def test_on_the_gpu_results_are_filled_into_buffers_used_before() -> None:
    cp = require_gpu()
    a, x = _results()
    with dask.config.set({**GPU_CONFIG, "overlap.result-pool-size": "8MiB"}):
        y = dask_overlap.map_blocks(cp.negative, x, dtype=np.float32)
        np.testing.assert_array_equal(y.compute(), -a)
        rt = dask_overlap.get_runtime("cuda")
        assert (rt.results.fresh, rt.results.idle_bytes) == (4, 4 * MiB)
        first = y.compute()  # into the four buffers of the first run
        np.testing.assert_array_equal(first, -a)
        assert (rt.results.reused, rt.results.fresh) == (4, 4)
