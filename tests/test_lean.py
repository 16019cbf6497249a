"""The per-partition path as users hit it with small chunks: the lean path (a partition of
one sub-chunk, run on the task's own thread) and ``direct-bytes`` (sub-chunks too small
to be worth staging skip the pinned ring)."""

from __future__ import annotations

import threading

import dask
import dask.array as da
import numpy as np
import pytest
from support import wait_until_idle

import dask_overlap
from dask_overlap.engine import Pipeline


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


def test_an_output_of_unknown_size_goes_through_the_ring():
    """With ``drop_axis`` and no declared chunks the output's size is only known once func
    has run: such a sub-chunk is staged, since its result may be large."""
    a, x = small()
    y = dask_overlap.map_blocks(lambda b: np.repeat(b, 50, axis=0), x, chunks=((np.nan,) * 6, 64))
    got = y.compute()
    np.testing.assert_array_equal(got, np.repeat(a, 50, axis=0))
    stats = wait_until_idle()
    assert stats["bytes_staged"] == a.nbytes and stats["bytes_unstaged"] == got.nbytes


def test_small_partitions_never_enter_the_engine(monkeypatch):
    """A partition of one sub-chunk runs its stages on the task's thread: no Pipeline is
    built, and no other thread of the runtime touches it (its copies are too small)."""
    built: list[int] = []
    init = Pipeline.__init__

    def counting(self, *args, **kwargs):
        built.append(1)
        init(self, *args, **kwargs)

    monkeypatch.setattr(Pipeline, "__init__", counting)
    a, x = small()
    threads: set[str] = set()

    def where(b: np.ndarray) -> np.ndarray:
        threads.add(threading.current_thread().name)
        return b * 3

    with dask.config.set(scheduler="sync"):
        np.testing.assert_array_equal(dask_overlap.map_blocks(where, x).compute(), a * 3)
    assert built == []
    assert threads == {threading.main_thread().name}
    y = dask_overlap.map_blocks(where, x, split_axis=0, sub_chunk_bytes="10KiB")
    np.testing.assert_array_equal(y.compute(), a * 3)
    assert len(built) == 6  # split partitions go through the engine


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
