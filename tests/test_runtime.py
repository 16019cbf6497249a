"""The per-process runtime and ``runtime_stats()``: counts that match the data moved."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
import warnings

import dask
import dask.array as da
import numpy as np
import pytest
from support import poll, wait_until_idle

import dask_overlap
from dask_overlap.config import Options
from dask_overlap.pipeline import runtime as runtime_module
from dask_overlap.pipeline.partition import PartitionSpec, run_partition

# These tests watch the ring with tiny arrays: every sub-chunk goes through it.
pytestmark = pytest.mark.usefixtures("ring_only")

REQUIRED = {
    "backend",
    "partitions",
    "sub_chunks",
    "bytes_h2d",
    "bytes_d2h",
    "in_flight",
    "pinned_bytes_in_use",
    "device_bytes_in_use",
    "pinned_fallbacks",
    "backpressure_seconds",
}


def data(rows=24, cols=10, chunk=8, dtype=np.float64) -> tuple[np.ndarray, da.Array]:
    a = np.arange(rows * cols, dtype=dtype).reshape(rows, cols)
    return a, da.from_array(a, chunks=(chunk, cols))


def test_stats_before_any_runtime_are_zeros():
    stats = dask_overlap.runtime_stats()
    assert REQUIRED <= stats.keys()
    assert stats["backend"] == "host"
    for key in REQUIRED - {"backend"}:
        assert stats[key] == 0, key


def test_stats_count_what_moved():
    a, x = data()
    y = dask_overlap.map_blocks(
        lambda b: (b * 0.5).astype(np.float32), x, split_axis=0, sub_chunk_bytes=8 * 10
    )
    np.testing.assert_array_equal(y.compute(), (a * 0.5).astype(np.float32))
    stats = wait_until_idle()
    assert REQUIRED <= stats.keys()
    assert stats["backend"] == "host"
    assert stats["partitions"] == 3
    assert stats["partitions_failed"] == 0
    assert stats["sub_chunks"] == 24  # one row each
    assert stats["bytes_h2d"] == a.nbytes
    assert stats["bytes_d2h"] == a.nbytes // 2  # float32 out
    assert stats["bytes_staged"] == a.nbytes  # pageable input, staged once
    assert stats["in_flight"] == 0
    assert stats["pinned_fallbacks"] == 0
    assert 1 <= stats["max_window"] <= 4
    assert stats["backpressure_seconds"] >= 0
    assert stats["pinned_bytes_in_use"] == 0
    assert stats["device_bytes_in_use"] == 0


def test_counts_accumulate_over_runs():
    a, x = data()
    for n in (1, 2, 3):
        dask_overlap.map_blocks(np.negative, x).compute()
        stats = wait_until_idle()
        assert stats["partitions"] == 3 * n
        assert stats["sub_chunks"] == 3 * n
        assert stats["bytes_h2d"] == a.nbytes * n


def test_results_are_ordinary_arrays_filled_from_the_ring():
    a, x = data()
    (y,) = dask.persist(dask_overlap.map_blocks(np.negative, x, split_axis=0, sub_chunk_bytes=80))
    stats = wait_until_idle()
    pool = dask_overlap.get_runtime().backend.pinned
    chunks = [np.asarray(c) for c in y.__dask_graph__().values()]
    # Dask holds ordinary NumPy arrays: nothing of the pool is kept
    assert all(type(c) is np.ndarray and not pool.owns(c) for c in chunks)
    assert stats["pinned_bytes_in_use"] == 0 and stats["pinned_bytes_held"] == 0
    # every byte went through the ring: staged in, copied out, unstaged
    assert stats["bytes_staged"] == stats["bytes_d2h"] == stats["bytes_unstaged"] == a.nbytes
    assert stats["pinned_fallbacks"] == 0
    assert 0 < stats["pinned_bytes_peak"] <= stats["pinned_pool_size"]
    np.testing.assert_array_equal(y.compute(), -a)


def test_pinned_outputs_stay_pinned_while_held_and_return_when_released():
    a, x = data()
    y = dask_overlap.map_blocks(np.negative, x, split_axis=0, sub_chunk_bytes=80, out="pinned")
    (y,) = dask.persist(y)
    stats = wait_until_idle()
    # the outputs are handed to Dask as pinned blocks, without a copy
    assert stats["pinned_bytes_in_use"] == stats["pinned_bytes_held"] == a.nbytes
    assert stats["bytes_unstaged"] == 0
    assert stats["device_bytes_in_use"] == 0
    assert stats["in_flight"] == 0
    np.testing.assert_array_equal(y.compute(), -a)
    del y
    stats = dask_overlap.runtime_stats()
    assert stats["pinned_bytes_in_use"] == 0
    assert stats["device_bytes_in_use"] == 0


def test_pinned_outputs_past_half_the_pool_are_ordinary_arrays():
    a, x = data()  # three outputs of 640 bytes; half of a 2,600-byte pool holds two
    with dask.config.set({"overlap.pinned-pool-size": 2600}):
        y = dask_overlap.map_blocks(np.negative, x, out="pinned")
        (y,) = dask.persist(y, scheduler="sync")  # one at a time: the ring is never in the way
        stats = wait_until_idle()
        assert stats["pinned_bytes_held"] == 2 * 640 <= stats["pinned_pool_size"] // 2
        assert stats["pinned_fallbacks"] == 1
        np.testing.assert_array_equal(y.compute(), -a)


def test_pinned_input_is_not_staged_again():
    a, x = data()
    y = dask_overlap.map_blocks(np.negative, x, split_axis=0, sub_chunk_bytes=80, out="pinned")
    (y,) = dask.persist(y)
    before = wait_until_idle()
    z = dask_overlap.map_blocks(np.negative, y, split_axis=0, sub_chunk_bytes=80)
    np.testing.assert_array_equal(z.compute(), a)
    after = wait_until_idle()
    assert after["bytes_h2d"] - before["bytes_h2d"] == a.nbytes
    assert after["bytes_staged"] == before["bytes_staged"]  # straight from pinned memory


@pytest.mark.parametrize("pool", [0, 100])
def test_pinned_pool_smaller_than_a_sub_chunk_falls_back(pool):
    """Not even one sub-chunk's ring room (80 bytes in, 80 out) fits: every buffer goes
    through ordinary memory, counted, and the result is still right."""
    a, x = data()
    with dask.config.set({"overlap.pinned-pool-size": pool}):
        y = dask_overlap.map_blocks(lambda b: b + 1, x, split_axis=0, sub_chunk_bytes=80)
        np.testing.assert_array_equal(y.compute(), a + 1)
    stats = wait_until_idle()
    assert stats["pinned_pool_size"] == pool
    assert stats["pinned_fallbacks"] == 24 + 24  # each sub-chunk's input and output
    assert stats["bytes_staged"] == stats["bytes_unstaged"] == 0
    assert stats["pinned_bytes_peak"] <= pool
    assert stats["pinned_bytes_in_use"] == 0


@pytest.mark.parametrize("pool", [700, "1MiB"])
def test_pinned_pool_smaller_than_the_result_waits_instead_of_falling_back(pool):
    """A ring smaller than a partition (640 bytes out) still takes every byte: sub-chunks
    wait for room instead of copying through ordinary memory."""
    a, x = data()
    with dask.config.set({"overlap.pinned-pool-size": pool, "num_workers": 3}):
        y = dask_overlap.map_blocks(lambda b: b + 1, x, split_axis=0, sub_chunk_bytes=80)
        np.testing.assert_array_equal(y.compute(), a + 1)
    stats = wait_until_idle()
    assert stats["pinned_fallbacks"] == 0
    assert stats["bytes_staged"] == stats["bytes_unstaged"] == a.nbytes
    assert 0 < stats["pinned_bytes_peak"] <= stats["pinned_pool_size"]
    assert stats["pinned_bytes_in_use"] == 0


def test_runtime_is_per_process_and_built_from_config():
    with dask.config.set({"overlap.pinned-pool-size": 12345, "overlap.streams": 3}):
        rt = dask_overlap.get_runtime()
        assert rt is dask_overlap.get_runtime()
        assert rt is dask_overlap.get_runtime("host")
        assert rt.name == "host"
        stats = dask_overlap.runtime_stats()
        assert stats["pinned_pool_size"] == 12345
        assert stats["streams"] == 3
    dask_overlap.close_runtimes()
    assert rt.closed
    fresh = dask_overlap.get_runtime()
    assert fresh is not rt
    assert dask_overlap.runtime_stats()["pinned_pool_size"] != 12345
    rt.close()  # idempotent


def test_settings_changed_later_apply_once_the_runtime_is_idle():
    """#13 item 12: not silently ignored. Idle: built again from them at once. Busy: a
    warning names them, once, and they apply when the partitions are done."""
    a, x = data()
    rt = dask_overlap.get_runtime("host")
    with dask.config.set({"overlap.streams": 3}):
        idle = dask_overlap.get_runtime("host")
        assert idle is not rt and rt.closed and len(idle.streams) == 3
        np.testing.assert_array_equal(dask_overlap.map_blocks(np.negative, x).compute(), -a)
    started, release = threading.Event(), threading.Event()

    def held(b):
        started.set()
        release.wait(10)
        return -b

    y = dask_overlap.map_blocks(held, x[:10], dtype=x.dtype, meta=x._meta)  # not called early
    result: list = []
    runner = threading.Thread(target=lambda: result.append(y.compute(scheduler="sync")))
    runner.start()
    assert started.wait(10)
    busy = dask_overlap.get_runtime("host")
    with dask.config.set({"overlap.streams": 2}):
        with pytest.warns(RuntimeWarning, match=r"overlap\.streams \(16 -> 2\)"):
            assert dask_overlap.get_runtime("host") is busy  # busy: kept, and warned
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert dask_overlap.get_runtime("host") is busy  # once
        release.set()
        runner.join(10)
        np.testing.assert_array_equal(result[0], -a[:10])
        rebuilt = dask_overlap.get_runtime("host")
        assert rebuilt is not busy and len(rebuilt.streams) == 2


@pytest.mark.parametrize(
    "key, value",
    [("in-flight", 2), ("sub-chunk-bytes", "1MiB"), ("fuse", False), ("stall-timeout", 99)],
)
def test_options_of_a_call_change_the_runtime_in_place(key, value):
    """Options read when a graph is built or as partitions go are not what a runtime is
    built of: a change of them (a dask.config.set around one call) keeps its pools and
    streams, with no warning while partitions run."""
    a, x = data()
    rt = dask_overlap.get_runtime("host")
    with dask.config.set({f"overlap.{key}": value}), warnings.catch_warnings():
        warnings.simplefilter("error")
        assert dask_overlap.get_runtime("host") is rt and not rt.closed
        field = key.replace("-", "_")
        assert getattr(rt.options, field) == getattr(Options.from_config(), field)
        np.testing.assert_array_equal(dask_overlap.map_blocks(np.negative, x).compute(), -a)
    assert dask_overlap.get_runtime("host") is rt


def test_a_task_that_got_a_runtime_just_retired_runs_on_the_new_one(monkeypatch):
    """Another thread's setting change may retire the runtime a task has just looked up,
    before the task starts on it: the task looks again, and never runs on a closed one."""
    from dask_overlap.pipeline import task as task_module

    a, x = data()
    real, raced = task_module.get_runtime, []

    def racing(backend):
        rt = real(backend)
        if not raced:  # once: between this lookup and the start, a change rebuilds it
            raced.append(rt)
            with dask.config.set({"overlap.streams": 3}):
                assert real(backend) is not rt and rt.closed
        return rt

    monkeypatch.setattr(task_module, "get_runtime", racing)
    y = dask_overlap.map_blocks(np.negative, x, split_axis=0)
    np.testing.assert_array_equal(y.compute(scheduler="sync"), -a)
    assert raced and raced[0].counters.partitions == 0  # nothing ran on the retired one


def test_a_task_that_got_a_runtime_just_closed_runs_on_another(monkeypatch):
    """A closed runtime refuses partitions (a plugin's torn down, say): the task that
    looked it up just before looks again; a lookup that hands it out again is an error,
    not a loop."""
    from dask_overlap.pipeline import task as task_module

    a, x = data()
    closed = runtime_module.Runtime(Options.from_config(backend="host"))
    closed.close()
    real, handed = task_module.get_runtime, []

    def once_closed(backend):
        handed.append(backend)
        return closed if len(handed) == 1 else real(backend)

    monkeypatch.setattr(task_module, "get_runtime", once_closed)
    y = dask_overlap.map_blocks(np.negative, x[:16], split_axis=0)
    np.testing.assert_array_equal(y.compute(scheduler="sync"), -a[:16])
    assert closed.counters.partitions == 0
    monkeypatch.setattr(task_module, "get_runtime", lambda backend: closed)
    with pytest.raises(RuntimeError, match="runtime closed under this task"):
        y.compute(scheduler="sync")


@pytest.mark.parametrize("fails", ["ResultPool", "freeze_heap_once"])
def test_a_runtime_that_fails_to_build_leaves_no_thread_behind(monkeypatch, fails):
    """A step of the construction that raises (a pool, the heap's freeze: the first and
    the last after threads start) stops the streams, copy and trim threads started."""

    def broken(*args, **kwargs):
        raise RuntimeError("no room")

    def ours() -> set[str]:
        return {t.name for t in threading.enumerate() if t.name.startswith("overlap-host")}

    before = ours()
    monkeypatch.setattr(runtime_module, fails, broken)
    with pytest.raises(RuntimeError, match="no room"):
        runtime_module.Runtime(Options.from_config(backend="host", freeze_heap=True))
    assert poll(lambda: ours() == before), ours() - before


def test_the_heap_is_not_frozen_while_distributed_is_half_imported(monkeypatch):
    """A module another thread is importing has no Worker class yet: a runtime built
    then neither fails (it did, with its threads left running) nor freezes the heap."""
    import types

    monkeypatch.setitem(sys.modules, "distributed.worker", types.ModuleType("distributed.worker"))
    assert runtime_module.freeze_heap_once() is False


def test_separate_runtimes_per_backend():
    host = dask_overlap.get_runtime("host")
    timed = dask_overlap.get_runtime("timed")
    assert host is not timed
    assert host.backend.name == "host" and timed.backend.name == "timed"
    assert dask_overlap.runtime_stats("timed")["backend"] == "timed"
    with dask.config.set({"overlap.backend": "timed"}):
        assert dask_overlap.runtime_stats()["backend"] == "timed"


@pytest.mark.timeout(60)
def test_many_partitions_at_once_share_the_runtime():
    """Partitions run concurrently on the scheduler's threads; the counters stay exact."""
    a = np.random.default_rng(0).standard_normal((64, 32))
    x = da.from_array(a, chunks=(4, 32))
    y = dask_overlap.map_blocks(
        np.cos, x, split_axis=0, batch=1, sub_chunk_bytes=32 * 8, in_flight=2
    )
    with dask.config.set(num_workers=8):
        np.testing.assert_array_equal(y.compute(), np.cos(a))
    stats = wait_until_idle()
    assert stats["partitions"] == 16
    assert stats["sub_chunks"] == 64
    assert stats["max_window"] == 2  # per partition
    assert stats["in_flight"] == 0
    assert stats["bytes_h2d"] == stats["bytes_d2h"] == a.nbytes
    assert stats["pinned_bytes_in_use"] == 0


@pytest.mark.parametrize("visible, expected", [(False, "host"), (True, "cuda")])
def test_auto_picks_cuda_only_when_a_gpu_is_visible(monkeypatch, visible, expected):
    from dask_overlap import backends

    monkeypatch.setattr(backends, "gpu_available", lambda: visible)
    assert backends.resolve_backend("auto") == expected
    for name in ("host", "timed", "cuda"):
        assert backends.resolve_backend(name) == name
    with pytest.raises(
        ValueError, match=r"backend must be one of auto, cuda, host, timed; got 'x'"
    ):
        backends.resolve_backend("x")


def test_auto_runs_on_the_host_backend_without_a_gpu(monkeypatch):
    from dask_overlap import backends

    monkeypatch.setattr(backends, "gpu_available", lambda: False)
    a, x = data()
    with dask.config.set({"overlap.backend": "auto"}):
        np.testing.assert_array_equal(dask_overlap.map_blocks(np.negative, x).compute(), -a)
        assert dask_overlap.runtime_stats()["backend"] == "host"


def test_large_staging_is_cut_into_pieces_for_the_copy_threads(monkeypatch):
    """A partition of one 64 MiB sub-chunk, with 4 idle copy threads, is staged as four
    16 MiB pieces: three on the copy threads, one on the task's own thread (which would
    only wait for them otherwise)."""
    from dask_overlap.backends.host import HostBackend

    seen: list[tuple[int, str]] = []
    stage = HostBackend.host_copy

    def recording(self, src, dst):
        import threading

        if self.pinned.owns(dst):  # into the ring: staging (unstaging copies out of it)
            seen.append((src.nbytes, threading.current_thread().name))
        stage(self, src, dst)

    monkeypatch.setattr(HostBackend, "host_copy", recording)
    data = np.ones((16384, 1024), dtype=np.float32)  # 64 MiB
    x = da.from_array(data, chunks=(16384, 1024))
    with dask.config.set({"overlap.staging-threads": 4}):
        y = dask_overlap.map_blocks(lambda b: b * 3, x, split_axis=0, sub_chunk_bytes="64MiB")
        np.testing.assert_array_equal(y.compute(), data * 3)
    assert sorted(n for n, _ in seen) == [16 << 20] * 4
    assert sorted("copy" in name for _, name in seen) == [False, True, True, True]
    assert dask_overlap.runtime_stats()["bytes_staged"] == data.nbytes


def test_a_stage_that_fails_when_issued_skips_the_stages_queued_after_it(monkeypatch):
    """H2D, kernel and D2H are issued together: if issuing the H2D itself raises, the
    kernel and D2H behind it are not issued, and the error reaches compute() as it was."""
    from dask_overlap.pipeline.runtime import Runtime

    class NoStream(RuntimeError):
        pass

    def acquire_stream(self):
        raise NoStream("no stream for you")

    monkeypatch.setattr(Runtime, "acquire_stream", acquire_stream)
    x = da.ones((64, 4), chunks=(16, 4))
    y = dask_overlap.map_blocks(lambda b: b + 1, x, split_axis=0, sub_chunk_bytes=32)
    with pytest.raises(NoStream, match="no stream for you"):
        y.compute()
    stats = wait_until_idle()
    assert stats["in_flight"] == 0
    assert stats["partitions_failed"] >= 1


@pytest.mark.parametrize(
    "partition, running, expected",
    [
        (256 << 20, 1, 64 << 20),  # alone: four sub-chunks in flight
        (256 << 20, 2, 128 << 20),
        (256 << 20, 4, 256 << 20),  # four partitions overlap: whole
        (256 << 20, 40, 256 << 20),
        (1 << 30, 8, 1 << 30),
        (16 << 20, 1, 64 << 20),  # never below 64 MiB: not cut at all
        (0, 1, 64 << 20),
    ],
)
def test_auto_sub_chunks_cut_only_as_far_as_the_running_partitions_need(
    partition, running, expected
):
    from dask_overlap.pipeline.layout import auto_sub_chunk_bytes

    assert auto_sub_chunk_bytes(partition, running) == expected


def test_auto_sub_chunks_follow_the_partitions_running(monkeypatch, as_on_a_device):
    """With ``sub-chunk-bytes: auto`` a partition that runs alone is cut in four; one that
    starts beside three others is not cut (where a device runs them: on the host backend
    alone, none is cut, tests/test_cpu_path.py)."""
    from dask_overlap.pipeline import layout

    monkeypatch.setattr(layout, "AUTO_MIN_BYTES", 1024)
    a = np.arange(64 * 128, dtype=np.float64).reshape(64, 128)  # one partition of 64 KiB
    x = da.from_array(a, chunks=(64, 128))
    rt = dask_overlap.get_runtime()
    assert rt.counters.sharing() == 0  # a fresh runtime (fresh_runtime): no burst before
    for others, subs in ((0, 4), (3, 1)):
        before = rt.stats()["sub_chunks"]
        running = [rt.counters.enter() for _ in range(others)]
        try:
            y = dask_overlap.map_blocks(np.negative, x, split_axis=0, sub_chunk_bytes="auto")
            np.testing.assert_array_equal(y.compute(), -a)
        finally:
            for e in running:
                rt.counters.leave(e)
        assert rt.stats()["sub_chunks"] - before == subs


def test_auto_sub_chunks_size_a_bursts_first_partition_by_the_burst_before(
    monkeypatch, as_on_a_device
):
    """A burst's first partitions start before the others have entered: after partitions
    that ran four at once, the next one to start alone is not cut (the same threads will
    run the others beside it); once a partition has run alone, the next one is cut."""
    from dask_overlap.pipeline import layout

    monkeypatch.setattr(layout, "AUTO_MIN_BYTES", 1024)
    a = np.arange(64 * 128, dtype=np.float64).reshape(64, 128)  # one partition of 64 KiB
    x = da.from_array(a, chunks=(64, 128))
    rt = dask_overlap.get_runtime()
    assert rt.counters.sharing() == 0  # a fresh runtime (fresh_runtime): no burst before
    y = dask_overlap.map_blocks(np.negative, x, split_axis=0, sub_chunk_bytes="auto")
    subs = []
    for others in (3, 0, 0, 0):
        before = rt.stats()["sub_chunks"]
        running = [rt.counters.enter() for _ in range(others)]
        np.testing.assert_array_equal(y.compute(), -a)
        for e in running:  # they leave after it: the last to leave ran four at once
            rt.counters.leave(e)
        subs.append(rt.stats()["sub_chunks"] - before)
    assert subs == [1, 1, 4, 4]


def test_counters_keep_the_most_partitions_that_ran_beside_the_last_to_leave():
    from dask_overlap.pipeline.stats import Counters

    c = Counters()
    assert c.sharing() == 0
    a = c.enter()
    b = c.enter()
    assert (a.peak, b.peak, c.sharing()) == (2, 2, 2)
    c.leave(b)
    d = c.enter()  # two again, not three: b left before d entered
    assert (a.peak, d.peak, c.partitions_active) == (2, 2, 2)
    c.leave(a)
    c.leave(d)
    assert (c.partitions_active, c.sharing()) == (0, 2)
    alone = c.enter()
    c.leave(alone)
    assert c.sharing() == 1
    assert "_last_peak" not in c.snapshot() and "_live" not in c.snapshot()


@pytest.mark.parametrize(
    "partition, expected",
    [
        (256 << 20, 32 << 20),
        (96 << 20, 32 << 20),
        ((64 << 20) + 1, ((64 << 20) + 3) // 3),
        (64 << 20, 32 << 20),
        (48 << 20, 24 << 20),
        (16 << 20, 16 << 20),
        (1, 1),
        (0, 1),
    ],
)
def test_auto_sub_chunks_of_pinned_input_are_even_pieces_of_at_most_32_mib(partition, expected):
    """Unstaged: however many partitions run, cut into even pieces of at most 32 MiB; a
    batch of small blocks of at most 64 MiB is not cut, a larger one is."""
    from dask_overlap.pipeline.layout import AUTO_MIN_BYTES, auto_sub_chunk_bytes

    for running in (1, 4, 40):
        assert auto_sub_chunk_bytes(partition, running, staged=False) == expected
        batch = auto_sub_chunk_bytes(partition, running, staged=False, batch=True)
        assert batch == (max(1, partition) if partition <= AUTO_MIN_BYTES else expected)


def test_auto_sub_chunks_cut_pinned_input_finer_than_pageable(monkeypatch, as_on_a_device):
    """A partition whose input is pinned already is cut into ``AUTO_UNSTAGED_BYTES`` pieces
    even beside three running partitions; the same partition from pageable memory, or
    pinned but cut along an axis whose sub-chunks are not whole rows, is not cut."""
    from dask_overlap.pipeline import layout

    monkeypatch.setattr(layout, "AUTO_MIN_BYTES", 1024)
    monkeypatch.setattr(layout, "AUTO_UNSTAGED_BYTES", 16 * 128 * 8)  # 16 rows
    a = np.arange(64 * 128, dtype=np.float64).reshape(64, 128)  # one partition of 64 KiB
    rt = dask_overlap.get_runtime()
    block = rt.backend.pinned.allocate(a.nbytes)  # back to the pool when collected
    assert block is not None
    pinned = block.view(a.dtype).reshape(a.shape)
    pinned[...] = a
    for source, axis, subs in ((pinned, 0, 4), (a, 0, 1), (pinned, 1, 1)):
        # (da.from_array would copy the block, into pageable memory)
        x = da.Array({("pinned-or-not", 0, 0): source}, "pinned-or-not", ((64,), (128,)), a.dtype)
        before = rt.stats()["sub_chunks"]
        running = [rt.counters.enter() for _ in range(3)]
        try:
            y = dask_overlap.map_blocks(np.negative, x, split_axis=axis, sub_chunk_bytes="auto")
            np.testing.assert_array_equal(y.compute(), -a)
        finally:
            for e in running:
                rt.counters.leave(e)
        assert rt.stats()["sub_chunks"] - before == subs, (axis, source is pinned)


def test_auto_sub_chunks_leave_a_batch_of_pinned_blocks_whole(monkeypatch, as_on_a_device):
    """The same 64 KiB of pinned rows: as one block, a partition cut into 16-row pieces;
    as four blocks of 16 rows joined by ``batch=4`` (a view of them, pinned), a batch of
    at most ``AUTO_MIN_BYTES``, one sub-chunk."""
    from dask_overlap.pipeline import layout

    monkeypatch.setattr(layout, "AUTO_MIN_BYTES", 64 * 128 * 8)
    monkeypatch.setattr(layout, "AUTO_UNSTAGED_BYTES", 16 * 128 * 8)  # 16 rows
    a = np.arange(64 * 128, dtype=np.float64).reshape(64, 128)
    rt = dask_overlap.get_runtime()
    block = rt.backend.pinned.allocate(a.nbytes)
    assert block is not None
    pinned = block.view(a.dtype).reshape(a.shape)
    pinned[...] = a
    one = da.Array({("one-block", 0, 0): pinned}, "one-block", ((64,), (128,)), a.dtype)
    four = da.Array(
        {("four-blocks", i, 0): pinned[16 * i : 16 * (i + 1)] for i in range(4)},
        "four-blocks",
        ((16,) * 4, (128,)),
        a.dtype,
    )
    for x, batch, partitions, subs in ((one, 1, 1, 4), (four, 4, 1, 1)):
        before = rt.stats()
        y = dask_overlap.map_blocks(np.negative, x, split_axis=0, batch=batch)
        np.testing.assert_array_equal(y.compute(), -a)
        after = rt.stats()
        assert after["partitions"] - before["partitions"] == partitions, x.name
        assert after["sub_chunks"] - before["sub_chunks"] == subs, x.name


def test_a_partition_of_one_sub_chunk_runs_on_its_own_thread(monkeypatch):
    """The lean path: a partition that is one sub-chunk enqueues and waits itself
    (Stream.run), with no hand-off to a stream thread; a split one uses the streams."""
    from dask_overlap.backends.host import HostStream

    submitted: list[int] = []
    submit = HostStream.submit

    def counting(self, fn, on_done):
        submitted.append(1)
        submit(self, fn, on_done)

    monkeypatch.setattr(HostStream, "submit", counting)
    a, x = data()
    np.testing.assert_array_equal(dask_overlap.map_blocks(np.negative, x).compute(), -a)
    assert submitted == []
    y = dask_overlap.map_blocks(np.negative, x, split_axis=0, sub_chunk_bytes=80)
    np.testing.assert_array_equal(y.compute(), -a)
    assert len(submitted) >= 24  # one per sub-chunk (and the completions behind them)


def test_a_pool_block_that_fails_to_come_gives_its_room_back(monkeypatch):
    """Any error while making a block (not only MemoryError) returns its charge: nothing
    of the pool leaks, through allocate() or a reservation."""
    from dask_overlap.backends.base import HostPool

    pool = HostPool(1000)

    def broken(self, nbytes):
        raise RuntimeError("no block")

    monkeypatch.setattr(HostPool, "_raw", broken)
    with pytest.raises(RuntimeError, match="no block"):
        pool.allocate(100)
    room = pool.reserve(300)
    with pytest.raises(RuntimeError, match="no block"):
        room.take(200)
    room.close()
    assert pool.in_use == 0 and pool.held == 0


def test_a_collection_under_the_pools_lock_gives_a_block_back_without_a_deadlock():
    """A block's finalizer gives its bytes back under the pool's lock; the collector may
    run it in a thread that holds that lock already (wait_for_room's predicate, any
    allocation there): with a plain Lock that thread waited on itself, and the worker
    behind it."""
    import gc

    from dask_overlap.backends.base import HostPool

    pool = HostPool(4 << 20)
    block = pool.allocate(1 << 20)
    cycle: list = [block, None]
    cycle[1] = cycle  # freed only by the collector
    del block, cycle
    done = threading.Event()

    def collect_holding_the_lock() -> None:
        with pool._cond:
            gc.collect()
        done.set()

    threading.Thread(target=collect_holding_the_lock, daemon=True).start()
    assert done.wait(10), "the pool's lock was taken again by the thread that held it"
    assert pool.in_use == 0 and pool.held == 0


def test_a_block_the_allocator_refuses_is_a_fallback_counted_as_refused(monkeypatch):
    """A fixed-size pool can be fragmented: the allocator refuses a block the budget had
    room for. The sub-chunk falls back to pageable memory (``pinned_fallbacks``) and the
    pool counts the refusal (``pinned_refused``), so that a fallback for lack of budget
    and one for fragmentation can be told apart; the result is right either way."""
    from dask_overlap.backends.base import HostPool

    real = HostPool._raw
    calls = {"n": 0}

    def fragmented(self, nbytes):
        calls["n"] += 1
        if calls["n"] == 2:  # the second block asked for: refused once
            raise MemoryError("fragmented")
        return real(self, nbytes)

    monkeypatch.setattr(HostPool, "_raw", fragmented)
    a, x = data()
    with dask.config.set({"overlap.direct-bytes": 0}):
        dask_overlap.close_runtimes()
        y = dask_overlap.map_blocks(np.negative, x, split_axis=0, sub_chunk_bytes=80, batch=1)
        np.testing.assert_array_equal(y.compute(scheduler="sync"), -a)
        stats = wait_until_idle()
    dask_overlap.close_runtimes()
    assert stats["pinned_refused"] == 1
    assert stats["pinned_fallbacks"] == 1  # that one, and none for lack of budget
    assert stats["pinned_bytes_in_use"] == 0


def test_cached_device_memory_goes_back_only_once_the_runtime_is_idle(monkeypatch):
    """The runtime asks its backend to trim (give cached device memory back) when no
    partition has run for a while, never while one runs."""
    monkeypatch.setattr(runtime_module, "TRIM_SECONDS", 0.02)
    rt = runtime_module.Runtime(Options.from_config(backend="host"))
    trims: list[int] = []
    monkeypatch.setattr(rt.backend, "trim", lambda: trims.append(rt.counters.partitions_active))
    try:
        started, release = threading.Event(), threading.Event()

        def slow(b):
            started.set()
            release.wait(10)
            return -b

        spec = PartitionSpec(("x", 0), (0,), 1, None, None, "auto", 2)
        done: list = []
        worker = threading.Thread(
            target=lambda: done.append(run_partition(rt, slow, (np.arange(4.0),), {}, spec))
        )
        worker.start()
        assert started.wait(10)
        trims.clear()  # (any trim before the partition started)
        time.sleep(0.3)  # fifteen looks while it runs
        assert trims == []
        release.set()
        worker.join(10)
        np.testing.assert_array_equal(done[0], -np.arange(4.0))
        poll(lambda: trims, 10, "a trim once idle")
        assert set(trims) == {0}
    finally:
        rt.close()


def test_which_partitions_auto_sizes_as_unstaged():
    """Only host arrays that are pinned already, cut into whole rows of theirs, skip the
    staged sizing: pageable input, a cut across rows, a column-ordered array, a batch's
    blocks or no bytes at all keep it; an input without the cut axis (broadcast) does not
    stop it."""
    from dask_overlap.pipeline.partition import PartitionSpec, _staged
    from dask_overlap.pipeline.pieces import PinnedBlocks

    rt = dask_overlap.get_runtime()
    block = rt.backend.pinned.allocate(2 * 64 * 8 * 8)
    assert block is not None
    pinned = block[: 64 * 8 * 8].view(np.float64).reshape(64, 8)
    row = block[64 * 8 * 8 : 64 * 8 * 8 + 8 * 8].view(np.float64)  # (8,): lacks axis 0

    def staged(*arrays, axis=0):
        spec = PartitionSpec(("x", 0), tuple(range(len(arrays))), 2, axis, axis, "auto", 4)
        return _staged(rt, list(arrays), spec)

    assert not staged(pinned)
    assert not staged(pinned, row)  # the row is broadcast: copied whole, pinned
    assert staged(np.ones((64, 8)))  # pageable
    assert staged(pinned, axis=1)  # sub-chunks are columns: not whole rows
    assert staged(np.asfortranarray(pinned))  # a copy, pageable and column-ordered
    assert staged(pinned[:, ::2])  # pinned, but not C-contiguous
    assert staged(np.empty((0, 8)))  # no bytes at all: the staged sizing
    assert staged(object.__new__(PinnedBlocks))  # a batch's blocks


FREEZE_PROBE = """
import gc, sys, weakref
import dask
import dask_overlap
setting = sys.argv[1] == "on"

def seen(obj):  # the collector's passes walk it (gc.get_objects leaves frozen ones out)
    return any(o is obj for o in gc.get_objects())

made_before = [[]]
with dask.config.set({"overlap.freeze-heap": setting}):
    print(gc.get_freeze_count())
    dask_overlap.get_runtime("host")
    print(gc.get_freeze_count(), seen(made_before))
    made_after = [[]]
    dask_overlap.close_runtimes()
    dask_overlap.get_runtime("host")  # a second runtime does not freeze again

    class Cycle:
        pass

    cycle = Cycle()
    cycle.me = cycle  # garbage only the collector's passes reclaim
    gone = weakref.ref(cycle)
    del cycle
    gc.collect()
    print(seen(made_after), gone() is None)
"""


@pytest.mark.parametrize("setting", ["on", "off"])
def test_the_first_runtime_freezes_the_heap_once_unless_told_not_to(setting: str) -> None:
    out = subprocess.run(
        [sys.executable, "-c", FREEZE_PROBE, setting],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout.split()
    frozen_at_start = int(out[0])  # 0 here; 375 on the GPU machine's Python 3.12
    if setting == "on":
        assert int(out[1]) > frozen_at_start + 1000  # the imported modules at least
        assert out[2] == "False"  # what was alive is out of the passes
    else:
        assert out[1:3] == [out[0], "True"]
    # What came later is walked and collected as before: a cycle made then is reclaimed.
    assert out[3:] == ["True", "True"]
