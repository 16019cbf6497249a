"""Under memory pressure and after failures: batches that fit the workers' memory, a failed
partition that gives its memory back at once, an error that names its block."""

from __future__ import annotations

import contextlib
import gc
import pickle
import threading
from collections.abc import Iterator
from typing import Any

import dask
import dask.array as da
import numpy as np
import pytest
from distributed import Client, LocalCluster, wait
from support import poll, require_gpu, wait_until_idle

import dask_overlap
from dask_overlap import LocalGPUCluster
from dask_overlap.graph import batch


@contextlib.contextmanager
def no_garbage_collector() -> Iterator[None]:
    """What is given back inside happens by reference counting alone."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


class Bad(ValueError):
    """func's own error, of a type of its own (kept through the pipeline and pickling)."""


def fails_in_block(block: int, rows: int) -> Any:
    """func that raises in the block whose first row is ``block * rows``."""

    def f(b: Any, block_info: Any = None) -> Any:
        if b.size and block_info is not None:
            if block_info[0]["array-location"][0][0] == block * rows:
                raise Bad("bad value encountered")
        return b * 2

    return f


# -- a failed partition gives its memory back before its exception leaves ------------------
@pytest.mark.parametrize(
    "backend, config",
    [
        ("timed", {}),  # a device of its own: the batch joins into the pinned pool
        ("host", {"overlap.direct-bytes": 0}),  # every sub-chunk through the ring
    ],
)
@pytest.mark.parametrize("scheduler", ["sync", "threads"])
def test_a_failed_partition_gives_its_pinned_memory_back_at_once(backend, config, scheduler):
    """The issue's example: a func that breaks the split axis's extent fails every
    partition; with the garbage collector off, no pinned byte is held afterwards, even
    while the exception (and its traceback) is still referenced."""
    x = da.ones((32768, 64), dtype="f4", chunks=(2048, 64))
    with dask.config.set({"overlap.backend": backend, **config}), no_garbage_collector():
        with pytest.raises(ValueError, match="keep the extent") as info:
            dask_overlap.map_blocks(lambda b: b[:-1], x, split_axis=0).compute(scheduler=scheduler)
        stats = wait_until_idle()
        assert stats["partitions_failed"] >= 1
        assert stats["pinned_bytes_held"] == 0 and stats["pinned_bytes_in_use"] == 0
        assert stats["device_bytes_in_flight"] == 0
        assert info.value.__traceback__ is not None  # the exception is still held


def test_every_failed_sub_chunk_gives_its_memory_back_not_only_the_first():
    """Two sub-chunks of one partition fail while in flight together: the partition
    raises the first, and the second's buffers are given back too, with the garbage
    collector off (a host stream's frame held its error in a cycle)."""
    fail, rows = 2, 8
    barrier = threading.Barrier(fail, timeout=5)

    def f(b: Any) -> Any:
        if b[0, 0] < fail * rows * 64:  # the first two sub-chunks, in flight together
            with contextlib.suppress(threading.BrokenBarrierError):
                barrier.wait()
            raise Bad("bad value encountered")
        return b

    x = da.from_array(np.arange(64 * 64, dtype="f8").reshape(64, 64), chunks=(64, 64))
    settings = {"overlap.backend": "host", "overlap.direct-bytes": 0}  # streams run at once
    with dask.config.set(settings), no_garbage_collector():
        y = dask_overlap.map_blocks(
            f, x, split_axis=0, sub_chunk_bytes=rows * 64 * 8, in_flight=4, dtype="f8"
        )
        with pytest.raises(Bad):
            y.compute(scheduler="sync")
        stats = wait_until_idle()
        assert stats["pinned_bytes_in_use"] == 0 and stats["device_bytes_in_flight"] == 0


def test_a_pool_that_held_a_failed_partitions_batch_serves_the_next_one():
    """What a failed partition gave back is there for the next one (no fallback)."""
    x = da.ones((32768, 64), dtype="f4", chunks=(2048, 64))
    with dask.config.set({"overlap.backend": "timed", "overlap.pinned-pool-size": "3MiB"}):
        with no_garbage_collector():
            for _ in range(3):
                with pytest.raises(ValueError):
                    dask_overlap.map_blocks(lambda b: b[:-1], x, split_axis=0).compute(
                        scheduler="sync"
                    )
            y = dask_overlap.map_blocks(lambda b: b + 1, x, split_axis=0)
            np.testing.assert_array_equal(y.compute(scheduler="sync"), 2)
    stats = wait_until_idle()
    assert stats["pinned_fallbacks"] == 0 and stats["pinned_bytes_in_use"] == 0


@pytest.mark.timeout(60)
def test_device_results_that_view_their_staged_input_hold_no_ring_block():
    """On the host backend (device memory is host memory), with every input staged in
    the ring, a func that returns a view of its block (b[::-1]) under out="device": the
    results are copied out of the ring, not handed on as ring blocks that Dask holds,
    which once filled the pool and left every later partition waiting for room."""
    a = np.arange(24 * 64 * 128, dtype="f8").reshape(24 * 64, 128)
    x = da.from_array(a, chunks=(64, 128))  # 24 blocks of 64 KiB, 1.5 MiB in all
    settings = {"overlap.backend": "host", "overlap.direct-bytes": 0}
    settings["overlap.pinned-pool-size"] = "1MiB"
    with dask.config.set(settings):
        y = dask_overlap.map_blocks(lambda b: b[::-1], x, out="device", split_axis=None)
        (done,) = dask.persist(y, scheduler="threads", num_workers=2)
        stats = wait_until_idle()
        assert stats["partitions"] == 24 and stats["pinned_bytes_in_use"] == 0
        np.testing.assert_array_equal(
            done.compute(scheduler="sync"), a.reshape(24, 64, 128)[:, ::-1].reshape(a.shape)
        )


# -- an error names its partition ----------------------------------------------------------
def test_an_error_keeps_its_type_and_names_the_partition_and_the_sub_chunk():
    a = np.arange(16 * 100 * 8, dtype="f8").reshape(1600, 8)
    x = da.from_array(a, chunks=(100, 8))
    y = dask_overlap.map_blocks(fails_in_block(5, 100), x, split_axis=0, sub_chunk_bytes=1600)
    with pytest.raises(Bad, match="bad value encountered") as info:
        y.compute(scheduler="sync")
    (note,) = info.value.__notes__
    assert f"partition ('{y.name}', 5, 0)" in note
    assert "sub-chunk 1 of 4 (rows 0:25)" in note and "failed in func" in note


def test_an_error_in_a_batch_names_the_blocks_it_holds():
    a = np.arange(16 * 100 * 8, dtype="f8").reshape(1600, 8)
    x = (da.from_array(a, chunks=(100, 8)) + 0).persist()  # blocks of their own (made first:
    # a "+ 0" in the graph would be fused into the batches, and named by a note of its own)

    def f(b: Any) -> Any:
        if b.size > 8 and b[0, 0] <= a[500, 0] < b[-1, 0]:  # the batch holding block 5
            raise Bad("bad value encountered")
        return b * 2

    y = dask_overlap.map_blocks(f, x, split_axis=0, batch=4)
    with pytest.raises(Bad) as info:
        y.compute(scheduler="sync")
    (note,) = info.value.__notes__
    assert f"partition ('{y.name}', 1, 0) (4 input blocks from block 4 along axis 0)" in note


def test_a_note_travels_with_a_pickled_exception():
    """distributed sends a task's exception pickled: the note goes with it."""
    e = Bad("bad value encountered")
    e.add_note("dask_overlap: partition ('f-1', 5, 0)")
    back = pickle.loads(pickle.dumps(e))
    assert type(back) is Bad and back.__notes__ == e.__notes__


def test_a_workers_error_reaches_the_client_with_its_type_and_note():
    a = np.arange(16 * 100 * 8, dtype="f8").reshape(1600, 8)
    x = da.from_array(a, chunks=(100, 8))
    with (
        LocalGPUCluster(allow_cpu=True, n_workers=1, threads_per_worker=2) as cluster,
        Client(cluster) as client,
    ):
        y = dask_overlap.map_blocks(fails_in_block(5, 100), x, split_axis=0)
        with pytest.raises(Bad, match="bad value encountered") as info:
            client.compute(y).result()
    assert any(f"partition ('{y.name}', 5, 0)" in n for n in info.value.__notes__)


# -- batches fit the workers' memory ------------------------------------------------------
def test_auto_batch_keeps_a_partition_within_the_budget():
    x = da.ones((2**20, 256), dtype="f4", chunks=(4096, 256))  # 256 blocks of 4 MiB
    args = (False, [x], (0,), 2, 0, None, None)
    assert batch.auto_batch(*args) == 16  # 64 MiB partitions with no bound
    assert batch.auto_batch(*args, budget=24 * 2**20 * batch.PEAK_MULTIPLE) == 6
    assert batch.auto_batch(*args, budget=2**20) == 1  # never below one block


def test_the_budget_is_the_smallest_workers_memory_per_thread_past_its_pause():
    assert batch.worker_budget() is None  # no distributed client
    with (
        LocalCluster(
            n_workers=2, threads_per_worker=2, memory_limit="400MiB", dashboard_address=None
        ) as cluster,
        Client(cluster),
    ):
        with dask.config.set(
            {"distributed.worker.memory.pause": 0.8, "distributed.worker.memory.terminate": 0.95}
        ):
            got = batch.worker_budget()
        assert got == pytest.approx(400 * 2**20 / 2 * 0.15, rel=0.01)
        with dask.config.set({"distributed.worker.memory.terminate": False}):
            assert batch.worker_budget() == pytest.approx(400 * 2**20 / 2 * 0.2, rel=0.01)


@pytest.mark.timeout(240)
def test_batch_auto_under_a_worker_memory_limit_kills_no_worker():
    """The issue's example: two workers of 300 MiB, 1 GiB of float32 output in 4 MiB
    chunks, the defaults. Before, batch="auto" joined 64 MiB partitions whatever the
    limit, workers were restarted again and again and the futures never finished."""
    with (
        LocalGPUCluster(
            allow_cpu=True, n_workers=2, threads_per_worker=2, memory_limit="300MiB"
        ) as cluster,
        Client(cluster) as client,
    ):
        workers = set(client.scheduler_info()["workers"])
        x = da.random.default_rng(9).random((2**20, 256), dtype="f4", chunks=(4096, 256))
        y = dask_overlap.map_blocks(lambda b: b * 2 + 1, x, split_axis=0)
        (f,) = client.persist([y])
        wait(f, timeout=180)
        assert {fut.status for fut in client.futures_of(f)} == {"finished"}
        assert bool(da.allclose(f, x * 2 + 1).compute())
        assert set(client.scheduler_info()["workers"]) == workers  # none killed, none new


# -- on the GPU: pinned and device memory back at once ------------------------------------
@pytest.mark.gpu
@pytest.mark.timeout(120)
def test_a_failed_partition_gives_pinned_and_device_memory_back_on_the_gpu():
    require_gpu()
    x = da.ones((32768, 64), dtype="f4", chunks=(2048, 64))
    config = {"overlap.backend": "cuda", "overlap.pinned-pool-size": "64MiB"}
    with dask.config.set(config):
        dask_overlap.map_blocks(lambda b: b + 1, x, split_axis=0).compute()  # warm
        before = wait_until_idle()["device_bytes_in_use"]
        with no_garbage_collector():
            with pytest.raises(ValueError, match="keep the extent"):
                dask_overlap.map_blocks(lambda b: b[:-1], x, split_axis=0).compute()
            stats = wait_until_idle()
            assert stats["pinned_bytes_held"] == 0 and stats["pinned_bytes_in_use"] == 0

            def device_back() -> bool:  # the scratch cache goes back once the runtime idles
                return dask_overlap.runtime_stats()["device_bytes_in_use"] <= before

            poll(device_back, 10, what="device memory back to its baseline, with no gc")
