"""The timed backend: the engine's overlap, measured as ratios of modelled engine times.

Every copy and kernel takes at least its modelled time and the three engines are
exclusive, so no run can beat its slowest engine. These tests assert ratios against
that bound and against the naive path in the same process, never absolute times.
"""

from __future__ import annotations

import functools
import time

import dask
import dask.array as da
import numpy as np
import pytest
from support import wait_until_idle

import dask_overlap

MB = 10**6
RATE = 100 * MB  # H2D, D2H and the kernel: balanced, so no single stage dominates
MODEL = {
    "overlap.backend": "timed",
    "overlap.timed.h2d-bandwidth": RATE,
    "overlap.timed.d2h-bandwidth": RATE,
    "overlap.timed.kernel-bandwidth": RATE,
    "overlap.timed.kernel-seconds": 0.0,
    "overlap.timed.pageable-h2d-bandwidth": RATE // 2,
    "overlap.timed.pageable-d2h-bandwidth": RATE // 2,
    "overlap.timed.staging-bandwidth": 100 * RATE,  # staging is not what this measures
    "overlap.in-flight": 4,
}

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


def kernel(b):
    return b * np.float32(1.5) + np.float32(1)


@pytest.fixture
def timed():
    with dask.config.set(MODEL):
        yield dask_overlap.get_runtime()


def make_input(rows=2048, cols=2048, chunk_rows=256) -> tuple[np.ndarray, da.Array]:
    a = np.random.default_rng(0).standard_normal((rows, cols), dtype=np.float32)
    return a, da.from_array(a, chunks=(chunk_rows, cols))


def persist_seconds(y: da.Array) -> tuple[float, da.Array]:
    """Seconds until every output chunk exists (no final concatenation)."""
    start = time.perf_counter()
    (y,) = dask.persist(y)
    return time.perf_counter() - start, y


def bound_seconds(rt, in_bytes: int, out_bytes: int) -> float:
    m = rt.backend.model
    # Staging in and unstaging out share the copy threads.
    host_copies = (in_bytes + out_bytes) / (m.staging_bandwidth * rt.copy_threads)
    return max(
        in_bytes / m.h2d_bandwidth,
        m.kernel_time(in_bytes),
        out_bytes / m.d2h_bandwidth,
        host_copies,
    )


def test_overlap_approaches_the_slowest_stage_and_beats_naive(timed):
    rt = timed
    assert rt.name == "timed"
    a, x = make_input()  # 16 MiB in 8 partitions; 0.17 s per engine at 100 MB/s
    overlapped = dask_overlap.map_blocks(kernel, x, split_axis=0, sub_chunk_bytes="256KiB")
    naive = da.map_blocks(functools.partial(rt.backend.naive, kernel), x, dtype=np.float32)

    # warm-up: threads, pool, first touch
    _, small = make_input(256, 2048, 128)
    dask.persist(dask_overlap.map_blocks(kernel, small, split_axis=0, sub_chunk_bytes="256KiB"))
    wait_until_idle()

    overlap_s, ours = min((persist_seconds(overlapped) for _ in range(2)), key=lambda r: r[0])
    naive_s, theirs = persist_seconds(naive)
    bound = bound_seconds(rt, a.nbytes, a.nbytes)

    # the same result, and the model holds: nothing beats its slowest engine
    np.testing.assert_array_equal(ours.compute(), theirs.compute())
    np.testing.assert_array_equal(ours.compute(), kernel(a))
    assert overlap_s >= 0.95 * bound
    # the makespan approaches the largest stage, not the sum of the stages
    assert bound / overlap_s >= 0.6, (bound, overlap_s)
    # the naive path does one step at a time, from pageable memory
    assert naive_s / overlap_s > 1.5, (naive_s, overlap_s)
    stats = wait_until_idle()
    assert stats["backend"] == "timed"
    assert stats["in_flight"] == 0
    assert stats["max_window"] == 4


def test_backpressure_with_a_window_of_one(timed):
    _, x = make_input(512, 512, 512)  # one partition of 1 MiB, 32 sub-chunks
    y = dask_overlap.map_blocks(kernel, x, split_axis=0, sub_chunk_bytes=512 * 4 * 16, in_flight=1)
    persist_seconds(y)
    stats = wait_until_idle()
    assert stats["sub_chunks"] == 32
    assert stats["max_window"] == 1
    # the submitter waited on a full window for (about) every sub-chunk's round trip
    assert stats["backpressure_seconds"] > 0
    busy = stats["busy_seconds"]
    assert stats["backpressure_seconds"] >= 0.5 * busy.get("h2d", 0.0)


def test_a_wider_window_overlaps_more(timed):
    """One partition: with a window of 1 the stages run one after another."""
    _, x = make_input(1024, 1024, 1024)  # 4 MiB: 0.04 s per engine
    times = {}
    for window in (1, 4):
        y = dask_overlap.map_blocks(
            kernel, x, split_axis=0, sub_chunk_bytes="128KiB", in_flight=window
        )
        times[window], _ = persist_seconds(y)
    assert times[1] / times[4] > 1.5, times
