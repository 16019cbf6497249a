"""The per-partition path as users hit it with small chunks: the lean path (a partition of
one sub-chunk, run on the task's own thread) and ``direct-bytes`` (sub-chunks too small
to be worth staging skip the pinned ring)."""

from __future__ import annotations

import re
import subprocess
import sys
import threading
from typing import Any

import dask
import dask.array as da
import numpy as np
import pytest
from support import wait_until_idle

import dask_overlap
import dask_overlap.graph.rewrite
from dask_overlap.pipeline.runtime import Span


def small() -> tuple[np.ndarray, da.Array]:
    a = np.random.default_rng(0).standard_normal((600, 64))  # 100 rows: 51 kB partitions
    return a, da.from_array(a, chunks=(100, 64))


def test_small_partitions_skip_the_ring_and_are_still_counted():
    a, x = small()
    (y,) = dask.persist(dask_overlap.map_blocks(np.negative, x))
    np.testing.assert_array_equal(y.compute(), -a)
    stats = wait_until_idle()
    assert stats["partitions"] == stats["sub_chunks"] == 6
    assert stats["bytes_h2d"] == a.nbytes
    # Straight in; and on the host backend, whose device memory is host memory, func's
    # result is the partition's result: nothing is copied out.
    assert stats["bytes_d2h"] == 0
    assert stats["bytes_staged"] == stats["bytes_unstaged"] == 0
    assert stats["pinned_bytes_peak"] == 0 and stats["pinned_fallbacks"] == 0
    assert stats["in_flight"] == stats["device_bytes_in_flight"] == 0
    assert stats["max_window"] == 1
    assert set(stats["busy_seconds"]) == {"h2d", "compute", "d2h"}
    pool = dask_overlap.get_runtime().backend.pinned
    chunks = [np.asarray(c) for c in y.__dask_graph__().values()]
    assert all(type(c) is np.ndarray and not pool.owns(c) for c in chunks)


@pytest.mark.parametrize(
    "direct, staged",
    [(0, True), ("51200B", True), ("102400B", False), ("102399B", True)],
    ids=["off", "only-the-input-fits", "in-and-out-fit", "one-byte-short"],
)
def test_direct_bytes_counts_what_moves_in_and_out(direct, staged):
    """A 51,200-byte partition moves 102,400 bytes in all: it skips the ring only when
    ``direct-bytes`` covers both directions."""
    a, x = small()
    with dask.config.set({"overlap.direct-bytes": direct}):
        np.testing.assert_array_equal(dask_overlap.map_blocks(np.negative, x).compute(), -a)
    stats = wait_until_idle()
    assert stats["bytes_staged"] == stats["bytes_unstaged"] == (a.nbytes if staged else 0)
    assert stats["bytes_h2d"] == a.nbytes
    assert stats["bytes_d2h"] == (a.nbytes if staged else 0)  # a direct result stays put


@pytest.mark.parametrize("direct", ["1MiB", "auto"])
def test_an_output_of_unknown_size_goes_through_the_ring(direct):
    """With ``drop_axis`` and no declared chunks the output's size is only known once func
    has run: such a sub-chunk is staged, since its result may be large (``1MiB``: the
    default where the device has memory of its own). On the host backend ``auto`` sends
    every sub-chunk straight through: there the ring would serve no device."""
    a, x = small()
    with dask.config.set({"overlap.direct-bytes": direct}):
        y = dask_overlap.map_blocks(
            lambda b: np.repeat(b, 50, axis=0), x, chunks=((np.nan,) * 6, 64)
        )
        got = y.compute()
    np.testing.assert_array_equal(got, np.repeat(a, 50, axis=0))
    stats = wait_until_idle()
    ringed = direct != "auto"
    assert stats["bytes_staged"] == (a.nbytes if ringed else 0)
    assert stats["bytes_unstaged"] == (got.nbytes if ringed else 0)


def test_small_partitions_run_on_the_tasks_own_thread():
    """A partition of one sub-chunk runs its stages on the task's thread: no other thread
    of the runtime touches it (its copies are too small); a partition cut in sub-chunks
    hands them to the runtime's streams."""
    a, x = small()
    threads: set[str] = set()

    def where(b: np.ndarray) -> np.ndarray:
        if b.size > 1:  # (not the calls on tiny blocks that infer the dtype and meta)
            threads.add(threading.current_thread().name)
        return b * 3

    with dask.config.set(scheduler="sync"):
        np.testing.assert_array_equal(dask_overlap.map_blocks(where, x).compute(), a * 3)
        assert threads == {threading.main_thread().name}
        threads.clear()
        y = dask_overlap.map_blocks(where, x, split_axis=0, sub_chunk_bytes="10KiB")
        np.testing.assert_array_equal(y.compute(), a * 3)
    assert threads and all(t.startswith("overlap-host-stream") for t in threads)


def test_a_failing_small_partition_leaves_nothing_behind():
    a, x = small()

    def boom(b: np.ndarray) -> np.ndarray:
        if b[0, 0] == a[300, 0]:
            raise ValueError("no good")
        return b

    with pytest.raises(ValueError, match="no good"):
        dask_overlap.map_blocks(boom, x).compute(scheduler="sync")
    stats = wait_until_idle()
    assert stats["partitions_failed"] == 1
    assert stats["partitions_active"] == stats["in_flight"] == 0
    assert stats["device_bytes_in_flight"] == 0 and stats["pinned_bytes_in_use"] == 0


def test_the_timeline_and_metrics_are_fed_by_the_lean_path():
    a, x = small()
    rt = dask_overlap.get_runtime("host")
    dask_overlap.map_blocks(np.negative, x).compute()
    spans = list(rt.timeline)
    assert sorted({s.stage for s in spans}) == ["compute", "d2h", "h2d"]
    assert len(spans) == 3 * 6
    assert all(s.end >= s.start and s.stream >= 0 for s in spans)


def test_sampled_timing_times_some_partitions_and_estimates_the_others(monkeypatch):
    """With stage timing sampled (CUDA's way: its marks are driver calls), the call's
    first partition is timed and, within the sampling period, its others are not; every
    partition still reaches the timeline, the busy seconds and the byte counts, its spans
    estimated from the timed one's and scaled by its bytes."""
    from dask_overlap.pipeline import sampling

    monkeypatch.setattr(sampling, "SAMPLE_SECONDS", 3600.0)  # one timed, in any test run
    a = np.random.default_rng(1).standard_normal((700, 64))
    x = da.from_array(a, chunks=(100, 64))  # 7 partitions of 100 rows
    x = da.concatenate([x, da.from_array(a[:50], chunks=(50, 64))])  # and one of 50
    rt = dask_overlap.get_runtime("host")
    rt.sampler = sampling.StageSampler()
    marks = []
    mark = rt.backend.mark
    monkeypatch.setattr(rt.backend, "mark", lambda stream: marks.append(1) or mark(stream))
    y = dask_overlap.map_blocks(np.negative, x)
    np.testing.assert_array_equal(y.compute(scheduler="sync"), -np.concatenate([a, a[:50]]))
    assert len(marks) == 4  # one partition timed: four marks
    stats = wait_until_idle()
    assert stats["partitions"] == 8 and stats["bytes_h2d"] == x.nbytes
    assert stats["sub_chunks_estimated"] == 7
    spans = [s for s in rt.timeline if s.key[0] == y.name]
    assert len(spans) == 3 * 8
    by_key: dict = {}
    for s in spans:
        by_key.setdefault(s.key, {})[s.stage] = s
    timed = by_key[(y.name, 0, 0)]
    half = by_key[(y.name, 7, 0)]  # 50 rows: half the bytes, so half the estimated time
    for stage in ("h2d", "compute"):
        assert half[stage].nbytes * 2 == timed[stage].nbytes
        took = timed[stage].end - timed[stage].start
        assert half[stage].end - half[stage].start == pytest.approx(took / 2)
    # Estimated stages follow each other, as they do on a stream.
    assert half["h2d"].end == half["compute"].start and half["compute"].end == half["d2h"].start
    assert sum(stats["busy_seconds"].values()) == pytest.approx(sum(s.end - s.start for s in spans))


def test_sampled_timing_samples_the_sub_chunks_of_cut_partitions_too(monkeypatch):
    """A partition cut into sub-chunks is sampled as whole ones are: with one sub-chunk in
    flight, the call's first is timed and the others estimated; each still has its three
    spans, the real bytes and its busy seconds."""
    from dask_overlap.pipeline import sampling

    monkeypatch.setattr(sampling, "SAMPLE_SECONDS", 3600.0)
    monkeypatch.setattr(sampling, "ALWAYS_TIMED_BYTES", 1)  # ignored for cut partitions
    a = np.random.default_rng(2).standard_normal((256, 32))
    rt = dask_overlap.get_runtime("host")
    rt.sampler = sampling.StageSampler()
    y = dask_overlap.map_blocks(
        np.negative,
        da.from_array(a, chunks=(128, 32)),
        split_axis=0,
        sub_chunk_bytes=32 * 32 * 8,  # 4 sub-chunks a partition
        in_flight=1,
    )
    np.testing.assert_array_equal(y.compute(scheduler="sync"), -a)
    stats = wait_until_idle()
    assert stats["partitions"] == 2 and stats["sub_chunks"] == 8
    assert stats["sub_chunks_estimated"] == 7
    assert stats["bytes_h2d"] == stats["bytes_d2h"] == a.nbytes
    spans = [s for s in rt.timeline if s.key[0] == y.name]
    assert sorted(s.stage for s in spans) == ["compute"] * 8 + ["d2h"] * 8 + ["h2d"] * 8
    assert all(s.end > s.start for s in spans)


@pytest.mark.parametrize("out", ["pinned", "device"])
def test_small_partitions_skip_the_ring_for_every_out(out):
    """Only the input is staged for ``out="device"`` (nothing comes back), and ``"pinned"``
    results are blocks of their own: small ones skip the ring either way."""
    a, x = small()
    got = dask_overlap.map_blocks(np.negative, x, out=out).compute()
    np.testing.assert_array_equal(got, -a)
    stats = wait_until_idle()
    assert stats["bytes_staged"] == stats["bytes_unstaged"] == 0
    assert stats["pinned_fallbacks"] == 0


def test_a_small_partitions_result_is_an_ordinary_array_on_the_host_backend():
    """Where a direct result is handed on as it is (the host backend), only an ordinary
    ndarray is: a subclass goes the copy's way, so every block has one type whatever the
    partition's size."""
    a, x = small()
    y = dask_overlap.map_blocks(lambda b: np.ma.masked_less(b, 0.0), x, dtype=a.dtype)
    (done,) = dask.persist(y)
    chunks = [np.asarray(c) for c in done.__dask_graph__().values()]
    assert [type(c) for c in done.__dask_graph__().values()] == [np.ndarray] * 6
    np.testing.assert_array_equal(np.concatenate(chunks), a)


def test_sub_chunks_that_fail_give_their_stream_leases_back():
    """A split partition whose func fails on some sub-chunks leaves no stream leased."""

    def fail_late(b):
        if b[0, 0] >= 300:
            raise ValueError("cursed")
        return -b

    x = da.from_array(np.arange(640.0).reshape(64, 10), chunks=(64, 10))
    for _ in range(3):
        with pytest.raises(ValueError, match="cursed"):
            dask_overlap.map_blocks(fail_late, x, split_axis=0, sub_chunk_bytes=160).compute(
                scheduler="sync"
            )
    wait_until_idle()
    assert sum(dask_overlap.get_runtime()._leases) == 0


# -- what a small partition leaves behind -------------------------------------------------
# (Its host cost is measured by benchmarks/host_overhead.py, against plain Dask's; the
# tests hold its results and its counts, not its calls.)
def test_a_small_partitions_counters_are_settled_when_it_ends():
    a, x = small()
    y = dask_overlap.map_blocks(np.negative, x)
    np.testing.assert_array_equal(y.compute(scheduler="sync"), -a)
    stats = wait_until_idle()
    assert stats["partitions"] == stats["sub_chunks"] == x.npartitions
    assert stats["bytes_h2d"] == a.nbytes
    assert stats["partitions_active"] == stats["in_flight"] == stats["window_capacity"] == 0
    assert stats["device_bytes_in_flight"] == 0 and stats["max_window"] == 1


def test_the_partitions_name_is_formatted_only_for_an_error(monkeypatch):
    """Errors name the partition by its key; a partition that succeeds never formats it."""
    from dask_overlap.pipeline import partition, results

    names: list[Any] = []
    real = results.partition_name

    def counting(key: Any) -> str:
        names.append(key)
        return real(key)

    monkeypatch.setattr(results, "partition_name", counting)
    monkeypatch.setattr(partition, "partition_name", counting)
    a, x = small()
    y = dask_overlap.map_blocks(np.negative, x)
    np.testing.assert_array_equal(y.compute(scheduler="sync"), -a)
    assert names == []
    bad = dask_overlap.map_blocks(lambda b: b[:, :3], x, dtype=a.dtype)  # declares 64 columns
    with pytest.raises(ValueError, match=re.escape(f"partition ('{bad.name}', ")) as info:
        bad.compute(scheduler="sync")  # the first partition to run fails, and ends the graph
    assert names and {key[0] for key in names} == {bad.name}
    assert f"partition {names[0]!r}" in str(info.value)


def test_the_lean_path_records_spans_with_their_partitions_key():
    a, x = small()
    rt = dask_overlap.get_runtime("host")
    y = dask_overlap.map_blocks(np.negative, x)
    y.compute(scheduler="sync")
    spans = list(rt.timeline)
    assert all(type(s) is Span for s in spans)
    assert sorted((s.key, s.stage) for s in spans) == sorted(
        ((y.name, i, 0), stage) for i in range(x.npartitions) for stage in ("h2d", "compute", "d2h")
    )
    assert {s.nbytes for s in spans if s.stage == "h2d"} == {a.nbytes // x.npartitions}


class _CountingLock:
    """A lock that counts how often it is taken."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.taken = 0

    def __enter__(self) -> None:
        self.lock.acquire()
        self.taken += 1

    def __exit__(self, *exc: Any) -> None:
        self.lock.release()


def test_the_process_runtime_is_found_without_its_lock_until_the_settings_change(monkeypatch):
    from dask_overlap.pipeline import runtime

    lock = _CountingLock()
    monkeypatch.setattr(runtime._runtimes, "lock", lock)
    rt = runtime.process_runtime("host")
    assert lock.taken == 1  # built
    assert all(runtime.process_runtime("host") is rt for _ in range(10))
    assert lock.taken == 1
    with dask.config.set({"overlap.streams": len(rt.streams) + 1}):
        again = runtime.process_runtime("host")
    assert again is not rt and rt.closed and len(again.streams) == len(rt.streams) + 1
    assert lock.taken == 2


NO_PLUGIN = """
import sys, dask, dask.array as da, numpy as np, dask_overlap
x = da.from_array(np.arange(600.0).reshape(6, 100), chunks=(1, 100))
got = dask_overlap.map_blocks(np.negative, x).compute(scheduler="sync")
assert (got == -np.arange(600.0).reshape(6, 100)).all()
print("distributed" in sys.modules, "dask_overlap.cluster.plugin" in sys.modules)
"""


def test_tasks_outside_a_worker_leave_the_plugin_module_alone():
    """Dask imports distributed on a first compute; a partition task still asks the
    plugin module for a worker's runtime only where that module was imported (a worker
    with an OverlapPlugin has it), so that each task does not pay for a get_worker() that
    raises."""
    done = subprocess.run(
        [sys.executable, "-c", NO_PLUGIN], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["True", "False"]


def test_partition_tasks_are_not_fused_into_their_inputs_subgraph():
    """Dask's linear fusion would run each slice of ``from_array`` and the partition as one
    subgraph, ordered anew on every run; the partition tasks opt out. Plain Dask's tasks on
    the same input still fuse (the check sees fusion happen), and the results agree."""
    a, x = small()
    ours = dask_overlap.map_blocks(np.negative, x)
    plain = da.map_blocks(np.negative, x)
    for arr, fused in ((ours, False), (plain, True)):
        keys = list(dask.core.flatten(arr.__dask_keys__()))
        dsk = arr.__dask_optimize__(arr.__dask_graph__(), keys)
        # A fused chain is stored under a new name, the block's key an alias to it.
        nodes = [dsk[getattr(dsk[k], "target", k)] for k in keys]
        subgraphs = [n for n in nodes if n.has_subgraph()]
        assert len(subgraphs) == (len(keys) if fused else 0)
        if not fused:
            # Each partition task, itself, not a subgraph: its input's block of data is put
            # into it as a value (rewrite.inlined_data), where a slice task stays beside it.
            assert all(n.key == k and n.block_fusion for n, k in zip(nodes, keys, strict=True))
    np.testing.assert_array_equal(ours.compute(), -a)


def test_with_fusion_off_two_stages_stay_two_partitions_a_block():
    _, x = small()
    with dask.config.set({"overlap.fuse": False}):
        y = dask_overlap.map_blocks(np.negative, x, split_axis=0, batch=1)
        z = dask_overlap.map_blocks(np.negative, y, split_axis=0, batch=1)
        dsk = _optimized(z)
        np.testing.assert_array_equal(z.compute(), x.compute())
    partitions = [t for t in dsk.values() if isinstance(t, dask_overlap.graph.rewrite._UnfusedTask)]
    assert len(partitions) == 2 * x.numblocks[0]


def _optimized(arr: da.Array) -> dict:
    keys = list(dask.core.flatten(arr.__dask_keys__()))
    return dict(arr.__dask_optimize__(arr.__dask_graph__(), keys))


@pytest.mark.parametrize(
    ("build", "stages"),
    [
        pytest.param(lambda x, f: f(x * 2), 1, id="elementwise-before"),
        pytest.param(lambda x, f: f(x) + 1, 1, id="elementwise-after"),
        pytest.param(lambda x, f: f(x).sum(axis=1), 1, id="reduction-after"),
        # two stages: dask_overlap's own fusion makes them one partition a block
        pytest.param(lambda x, f: f(f(x)), 1, id="two-stages"),
    ],
)
def test_partition_tasks_are_not_fused_with_blockwise_neighbours(build, stages):
    """Dask's blockwise fusion would merge an elementwise step before or after the
    partitions (or a reduction's first step, or a second partition layer) into one task
    a block, run as a subgraph; each partition stays its own task (what comes after it
    taken into the partition by dask_overlap's fusion, graph/fusion.py), and plain Dask
    still fuses the same graph (the check sees fusion happen)."""
    _, x = small()

    def ours(arr: da.Array) -> da.Array:
        return dask_overlap.map_blocks(np.negative, arr, split_axis=0, batch=1)

    def plain(arr: da.Array) -> da.Array:
        return da.map_blocks(np.negative, arr)

    got = build(x, ours)
    dsk = _optimized(got)
    partitions = [t for t in dsk.values() if isinstance(t, dask_overlap.graph.rewrite._UnfusedTask)]
    assert len(partitions) == stages * x.numblocks[0]
    assert not any(t.has_subgraph() for t in partitions)
    assert any(t.has_subgraph() for t in _optimized(build(x, plain)).values())
    np.testing.assert_array_equal(got.compute(), build(x, plain).compute())


def test_a_users_annotations_stay_beside_the_one_that_keeps_partitions_apart():
    _, x = small()
    with dask.annotate(retries=2):
        y = dask_overlap.map_blocks(np.negative, x, split_axis=0, batch=1)
    # Built as Dask builds its own map_blocks layer; kept apart where Dask's optimization runs.
    assert y.dask.layers[y.name].annotations == {"retries": 2}
    rewrite = dask_overlap.graph.rewrite
    kept = rewrite.kept_apart(y.dask).layers[y.name]
    assert kept.annotations == {"retries": 2, rewrite.PARTITION_ANNOTATION: y.name}
    assert y.dask.layers[y.name].annotations == {"retries": 2}  # (a copy was annotated)


def _made_from_nothing() -> da.Array:
    return da.ones((600, 64), chunks=(100, 64))


@pytest.mark.parametrize(
    ("build", "merged"),
    [
        pytest.param(lambda f: f(_made_from_nothing()), True, id="one-reader"),
        # read by two layers: Dask's own fusion would not merge it into either
        pytest.param(lambda f: (lambda o: f(o) + o.sum())(_made_from_nothing()), False, id="two"),
    ],
)
def test_a_layer_that_makes_blocks_from_nothing_is_merged_into_its_partitions(build, merged):
    """``da.ones`` read by a partition layer alone runs in the partition's task, one task a
    block, as Dask merges it into any reader; read by another layer too, it stays apart."""

    def ours(arr: da.Array) -> da.Array:
        return dask_overlap.map_blocks(np.negative, arr, split_axis=0, batch=1)

    got = build(ours)
    dsk = _optimized(got)
    partitions = [t for t in dsk.values() if isinstance(t, dask_overlap.graph.rewrite._UnfusedTask)]
    ones = [k for k in dsk if dask.utils.key_split(k) == "ones_like"]
    assert len(partitions) == (0 if merged else 6)  # merged: inside the fused blocks' subgraphs
    assert len(ones) == (0 if merged else 6)
    np.testing.assert_array_equal(got.compute(), build(lambda a: -a).compute())


def test_a_user_annotated_source_stays_apart_from_the_partitions():
    with dask.annotate(retries=4):
        src = da.ones((600, 64), chunks=(100, 64))
    y = dask_overlap.map_blocks(np.negative, src, split_axis=0, batch=1)
    dsk = _optimized(y)
    assert len([k for k in dsk if dask.utils.key_split(k) == "ones_like"]) == 6
    np.testing.assert_array_equal(y.compute(), -np.ones((600, 64)))
