"""The timed backend: the engine's overlap, from the stage spans each run records.

Every copy and kernel takes at least its modelled time and the three engines are
exclusive, so no run can beat its slowest engine: that bound is asserted (a run on a
loaded machine is only slower). How close a run comes to it, and how much faster than the
naive path, is a measurement on a shared machine, not a test: ``python
benchmarks/bench_overlap.py --backend timed`` reports both (``overlap_over_bound``, the naive
seconds; results in ``benchmarks/results/overlap-timed.json``). Here the overlap is asserted
as counts and orderings of the recorded spans.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Iterable

import dask
import dask.array as da
import numpy as np
import pytest
from support import wait_until_idle

import dask_overlap
from dask_overlap.pipeline.runtime import Span

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


def test_the_model_holds_on_the_overlapped_and_the_naive_path(timed):
    """Both paths give Dask's result and neither beats what the model allows; how close the
    overlapped path comes to its bound, and how far the naive one stays, is
    bench_overlap.py's to measure (see the module docstring)."""
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
    assert overlap_s >= 0.95 * bound, (bound, overlap_s)
    # the naive path takes its turns on the legacy stream: one step at a time, from pageable
    # memory, so no sooner than the sum of its round trips
    m = rt.backend.model
    round_trips = (
        a.nbytes / m.pageable_h2d_bandwidth
        + x.npartitions * m.kernel_time(a.nbytes // x.npartitions)
        + a.nbytes / m.pageable_d2h_bandwidth
    )
    assert naive_s >= 0.95 * round_trips, (round_trips, naive_s)
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
    # The submitter waited on a full window for every sub-chunk's round trip but the last's:
    # each of those waits holds the sub-chunk's copy-in, so they add up to at least most of
    # the copy-ins' busy time (a bound, not a timing: load stretches a copy-in and the wait
    # that holds it alike).
    assert stats["backpressure_seconds"] > 0
    busy = stats["busy_seconds"]
    assert stats["backpressure_seconds"] >= 0.5 * busy.get("h2d", 0.0)


def in_flight_at_once(spans: Iterable[Span]) -> int:
    """The most sub-chunks under way at one instant: each from the start of its first stage
    to the end of its last, as its spans say."""
    lives: dict[int, tuple[float, float]] = {}
    for s in spans:
        start, end = lives.get(s.sub_chunk, (s.start, s.end))
        lives[s.sub_chunk] = (min(start, s.start), max(end, s.end))
    # At one instant an end sorts before a start: lives that only touch do not overlap.
    edges = sorted([(end, -1) for _, end in lives.values()] + [(st, 1) for st, _ in lives.values()])
    most = now = 0
    for _, step in edges:
        now += step
        most = max(most, now)
    return most


@pytest.mark.usefixtures("timed", "ring_only")
def test_a_wider_window_overlaps_more():
    """One partition of 32 sub-chunks, through the ring. A window of 1 runs them one after
    another: each starts once the one before has ended. A window of 4 has four under way at
    once. Both are orderings of the spans, whatever the machine's load: a sub-chunk's stage
    span starts when the submitter hands it out, and its unstage span ends before the
    submitter hears that it is done, which is when the window lets the next one in."""
    _, x = make_input(1024, 1024, 1024)  # 4 MiB
    for window in (1, 4):
        y = dask_overlap.map_blocks(
            kernel, x, split_axis=0, sub_chunk_bytes="128KiB", in_flight=window
        )
        dask.persist(y)
        spans = [s for s in dask_overlap.get_runtime().timeline if s.key[0] == y.name]
        assert {s.sub_chunk for s in spans} == set(range(32))
        assert {s.stage for s in spans} == {"staging", "h2d", "compute", "d2h", "unstaging"}
        assert in_flight_at_once(spans) == window
        assert wait_until_idle()["max_window"] == window
