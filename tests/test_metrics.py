"""What partition tasks and workers report: fine performance metrics, heartbeats, Prometheus."""

from __future__ import annotations

import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import dask
import dask.array as da
import numpy as np
import pytest
from distributed import Client, LocalCluster, span, wait
from distributed.metrics import context_meter
from distributed.utils import key_split
from support import poll

import dask_overlap
from dask_overlap.metrics import prometheus, timeline
from dask_overlap.metrics.summary import worker_metrics
from dask_overlap.metrics.worker import (
    HEARTBEAT_IDLE_SECONDS,
    HEARTBEAT_SPAN_LIMIT,
    METRICS_NAME,
    TIMELINE_HANDLER,
    detail,
    heartbeat,
    install_worker_metrics,
    transfer_spans,
    uninstall_worker_metrics,
)
from dask_overlap.pipeline import nvtx, stages
from dask_overlap.pipeline.meter import TaskMeter, busy_unit

STAGE_LABELS = (
    "overlap-staging",
    "overlap-h2d",
    "overlap-compute",
    "overlap-d2h",
    "overlap-unstaging",
)
# Half of this pool (what pinned results may keep) is smaller than one partition's output:
# with out="pinned" every output falls back to an ordinary array (counted), while the
# ring's half still holds a 16 KiB sub-chunk's way in and out.
# Tiny arrays, through the ring all the same (direct_bytes=0).
PLUGIN = dict(backend="host", pinned_pool_size="64KiB", in_flight=2, streams=2, direct_bytes=0)


def double(b: np.ndarray) -> np.ndarray:
    return b * 2


# -- the meter, without a cluster -----------------------------------------------------
def test_task_meter_totals_and_units() -> None:
    m = TaskMeter(("x", 0), "host")
    m.waited("h2d", 0.25, for_room=False)
    m.waited(metrics_stage("D2H"), 0.5, for_room=False)
    m.waited("h2d", 1.0, for_room=True)  # a full window: backpressure, not a stage
    m.spans([("staging", 0.0, 1.0, 10), ("h2d", 1.0, 3.0, 10), ("compute", 3.0, 4.0, 10)])
    m.spans([("d2h", 4.0, 4.5, 8)])
    m.fallback(2)
    m.fallback(0)
    got = {(label, unit): v for label, unit, v in m.metrics()}
    assert got == {
        ("overlap-h2d", "seconds"): 0.25,
        ("overlap-d2h", "seconds"): 0.5,
        ("overlap-backpressure", "seconds"): 1.0,
        ("overlap-staging", "stream-seconds"): 1.0,
        ("overlap-h2d", "stream-seconds"): 2.0,
        ("overlap-compute", "stream-seconds"): 1.0,
        ("overlap-d2h", "stream-seconds"): 0.5,
        ("overlap-staging", "bytes"): 10,
        ("overlap-h2d", "bytes"): 10,
        ("overlap-d2h", "bytes"): 8,
        ("overlap-pinned-fallback", "count"): 2,
    }
    assert busy_unit("cuda") == "gpu-seconds"
    assert all(unit != "seconds" for unit in {busy_unit(b) for b in ("cuda", "host", "timed")})


def metrics_stage(name: str) -> Any:
    from dask_overlap.pipeline.engine import Stage

    return Stage[name]


def test_digest_goes_to_the_context_meter_of_this_thread_only() -> None:
    m = TaskMeter(("x", 0), "host")
    m.spans([("h2d", 0.0, 1.0, 100)])
    got: list[tuple] = []
    with context_meter.add_callback(lambda label, value, unit: got.append((label, unit, value))):
        with m.task():
            pass
    assert ("overlap-h2d", "bytes", 100) in got
    assert ("overlap-h2d", "stream-seconds", 1.0) in got


def test_nvtx_ranges_are_named_after_the_key_and_sub_chunk(monkeypatch) -> None:
    pushed: list[tuple[str, int]] = []
    popped: list[None] = []
    fake = (lambda msg, color: pushed.append((msg, color)), lambda: popped.append(None))
    monkeypatch.setattr(nvtx, "_nvtx", lambda: fake)
    monkeypatch.setattr(nvtx, "_profiled", lambda: False)
    with nvtx.nvtx_range("cuda", ("x", 1)):  # no profiler attached: nothing
        pass
    monkeypatch.setattr(nvtx, "_profiled", lambda: True)
    with nvtx.nvtx_range("host", ("x", 1)):  # not the cuda backend: nothing
        pass
    assert pushed == []
    with nvtx.nvtx_range("cuda", ("x", 1)):
        with nvtx.nvtx_range("cuda", ("x", 1), 3, "h2d"):
            pass
    assert [p[0] for p in pushed] == ["('x', 1)", "('x', 1) #3 h2d"]
    assert len(popped) == 2
    # In the colours the dashboard draws the stages with.
    assert pushed[1][1] == 0xFF000000 | int(stages.COLORS["h2d"][1:], 16)


def test_rates_and_overlap_count_only_the_part_of_a_span_in_their_window() -> None:
    from dask_overlap.pipeline.runtime import Span

    key = ("x", 0)
    # A 10 s copy of 10 GB (1 GB/s), then a kernel over the copy's last second.
    copy = Span(key, 0, 0, "h2d", 0.0, 10.0, 10 * 10**9)
    kernel = Span(key, 0, 1, "compute", 9.0, 10.0, 0)
    moved, busy, wall = timeline.window_totals([copy], now=10.0, seconds=2.0)
    assert moved["h2d"] == pytest.approx(2e9) and busy == wall == pytest.approx(2.0)
    moved, busy, wall = timeline.window_totals([copy, kernel], now=10.0, seconds=2.0)
    assert busy / wall == pytest.approx(1.5)  # never more than the stages that overlapped
    # A copy of no length that ended inside the window counts whole; one before it not.
    instant = Span(key, 1, 0, "d2h", 9.5, 9.5, 100)
    old = Span(key, 2, 0, "d2h", 1.0, 2.0, 100)
    moved, _, _ = timeline.window_totals([instant, old], now=10.0, seconds=2.0)
    assert moved["d2h"] == 100


def test_worker_metrics_heartbeat_and_detail_of_a_threaded_run() -> None:
    x = da.ones((64, 1024), chunks=(32, 1024))
    y = dask_overlap.map_blocks(double, x, split_axis=0, sub_chunk_bytes="32KiB")
    with dask.config.set({"overlap.backend": "host"}):
        np.testing.assert_array_equal(y.compute(), 2 * np.ones((64, 1024)))
    rt = dask_overlap.get_runtime("host")
    now = max(s.end for s in rt.timeline)
    m = worker_metrics(rt, now=now)
    assert m["bytes_h2d"] == m["bytes_d2h"] == x.nbytes
    assert m["h2d_bytes_per_second"] > 0 and m["d2h_bytes_per_second"] > 0
    assert m["overlap_efficiency"] >= 1.0  # busy time over the wall time when busy
    assert m["window_capacity"] == rt.options.in_flight  # nothing running now
    cols = detail(rt, seconds=60, limit=5, now=now)["timeline"]
    assert set(cols) == set(timeline.COLUMNS)
    assert {len(v) for v in cols.values()} == {5}
    assert set(cols["stage"]) <= set(stages.STAGES)
    assert detail(rt, seconds=60, limit=0, now=now)["timeline"]["start"] == []
    # A heartbeat carries the same newest spans, each key listed once.
    beat = heartbeat(rt, seconds=60, limit=5, now=now)
    assert beat["bytes_h2d"] == x.nbytes
    assert len(beat["recent"]["keys"]) == len(set(cols["key"]))
    assert timeline.unpack(beat["recent"]) == cols
    assert heartbeat(rt, seconds=60, limit=0, now=now)["recent"]["start"] == []
    # The last seconds of activity, for a while after it: then none.
    later = heartbeat(rt, limit=5, now=now + HEARTBEAT_IDLE_SECONDS - 1)["recent"]
    assert timeline.unpack(later) == cols
    assert heartbeat(rt, limit=5, now=now + HEARTBEAT_IDLE_SECONDS + 1)["recent"]["start"] == []


def test_recent_spans_and_busy_wall_time() -> None:
    from dask_overlap.pipeline.runtime import Span

    spans = [Span(("x", 0), i, 0, "h2d", float(i), i + 0.5, 1) for i in range(10)]
    assert [s.sub_chunk for s in timeline.recent(spans, now=9.5, seconds=2.0)] == [7, 8, 9]
    assert timeline.busy_wall_seconds([(0, 2), (1, 3), (5, 6), (5.5, 5.7)]) == 4.0
    assert timeline.busy_wall_seconds([]) == 0.0


def test_a_heartbeat_carries_a_bounded_window_of_spans() -> None:
    from dask_overlap.pipeline.runtime import Span

    rt = dask_overlap.get_runtime("host")
    rt.timeline.clear()
    n = 3 * HEARTBEAT_SPAN_LIMIT
    try:
        rt.timeline.extend(
            Span(("k", i // 10), i, 0, "h2d", 0.001 * i, 0.001 * i + 1e-4, 8) for i in range(n)
        )
        recent = heartbeat(rt, seconds=60, now=0.001 * n)["recent"]
        assert recent["sub_chunk"] == list(range(n - HEARTBEAT_SPAN_LIMIT, n))  # the newest
        assert len(recent["keys"]) == HEARTBEAT_SPAN_LIMIT // 10  # each key listed once
        assert len(heartbeat(rt, seconds=0.0995, now=0.001 * n)["recent"]["start"]) == 100
    finally:
        rt.timeline.clear()


class FakeWorker:
    address = "tcp://fake:1"

    def __init__(self) -> None:
        self.metrics: dict[str, Any] = {}
        self.handlers: dict[str, Any] = {}
        self.transfer_incoming_log: list[dict[str, Any]] = []


def test_transfers_ride_the_heartbeat_on_their_own_lane() -> None:
    """#16: what Dask moved in from other workers (distributed's transfer log) travels with
    the spans, as stage ``transfer`` on lane -2, in the heartbeat and the detailed view."""
    from dask_overlap.pipeline.runtime import Span

    rt = dask_overlap.get_runtime("host")
    rt.timeline.clear()
    w = FakeWorker()
    t = time.time()
    w.transfer_incoming_log.append(
        {"start": t - 0.5, "stop": t - 0.2, "keys": {("y", 3): 96, ("y", 4): 32}, "total": 128}
    )
    rt.timeline.append(Span(("z", 0), 0, 0, "h2d", t - 0.3, t - 0.1, 64))
    install_worker_metrics(w, rt)  # type: ignore[arg-type]
    try:
        for cols in (
            timeline.unpack(w.metrics[METRICS_NAME](w)["recent"]),
            w.handlers[TIMELINE_HANDLER](seconds=60)["timeline"],
        ):
            # Oldest end first, the transfer among the stages.
            assert cols["stage"] == ["transfer", "h2d"]
            assert cols["stream"] == [stages.TRANSFER_LANE, 0]
            assert cols["key"] == [str(("y", 3)), str(("z", 0))]
            assert cols["sub_chunk"][0] == 2 and cols["nbytes"][0] == 128
        # The runtime's own tallies leave transfers out: they are not a stage it ran.
        assert w.metrics[METRICS_NAME](w)["bytes_h2d"] == rt.counters.snapshot()["bytes_h2d"]
    finally:
        uninstall_worker_metrics(w)  # type: ignore[arg-type]
        rt.timeline.clear()
    assert transfer_spans([]) == []


def test_install_and_prometheus_collector() -> None:
    from distributed.http.prometheus import PrometheusCollector
    from prometheus_client import REGISTRY, generate_latest

    rt = dask_overlap.get_runtime("host")
    rt.counters.add(bytes_h2d=123)
    w = FakeWorker()
    install_worker_metrics(w, rt)  # type: ignore[arg-type]
    try:
        assert w.metrics[METRICS_NAME](w)["bytes_h2d"] == 123
        assert w.handlers[TIMELINE_HANDLER](seconds=1, limit=1)["bytes_h2d"] == 123
        text = generate_latest(REGISTRY).decode()
        assert 'dask_overlap_bytes_total{direction="h2d",worker="tcp://fake:1"} 123.0' in text
    finally:
        uninstall_worker_metrics(w)  # type: ignore[arg-type]
    assert w.metrics == w.handlers == {}
    assert "tcp://fake:1" not in generate_latest(REGISTRY).decode()
    # One collector per process, of distributed's kind, however many workers installed.
    ours = [c for c in REGISTRY._collector_to_names if isinstance(c, prometheus.OverlapCollector)]
    assert len(ours) == 1 and isinstance(ours[0], PrometheusCollector)


def test_install_and_uninstall_while_a_heartbeat_awaits_a_metric() -> None:
    """Where RMM is installed, distributed adds an awaitable ``rmm`` metric (``gpu`` with
    NVML), and a heartbeat awaits it in the middle of iterating ``Worker.metrics``: the
    plugin's setup or teardown then (a plugin registered on a running cluster, a worker
    closing) must not change that dict under it. It did: "dictionary changed size during
    iteration" closed an H100 machine's worker. Here a metric of the same kind stands in."""
    import asyncio

    from distributed import Scheduler, Worker

    rt = dask_overlap.get_runtime("host")

    async def main() -> list[dict[str, Any]]:
        started, release = asyncio.Event(), asyncio.Event()

        async def awaited(worker: Any) -> str:  # as distributed's rmm_metric
            started.set()
            await release.wait()
            return "done"

        got = []
        async with (
            Scheduler(dashboard_address=":0") as s,
            Worker(s.address, nthreads=1) as w,
        ):
            for change in (
                lambda: install_worker_metrics(w, rt),
                lambda: uninstall_worker_metrics(w),
            ):
                w.metrics = {"awaited": awaited, **w.metrics, "after": lambda worker: 1}
                started.clear()
                release.clear()
                pending = asyncio.ensure_future(w.get_metrics())
                await asyncio.wait_for(started.wait(), 10)
                change()
                release.set()
                got.append(await asyncio.wait_for(pending, 10))
            assert METRICS_NAME not in w.metrics
        return got

    during_install, during_uninstall = asyncio.run(main())
    # Each heartbeat reports the metrics there were when it began.
    assert during_install["awaited"] == "done" and METRICS_NAME not in during_install
    assert during_uninstall["after"] == 1 and METRICS_NAME in during_uninstall


# -- on a real cluster ----------------------------------------------------------------
#: Worker processes whose own HTTP servers (their /metrics) are up, on free ports.
WITH_WORKER_DASHBOARDS = dict(
    threads_per_worker=2,
    processes=True,
    dashboard_address=None,
    worker_dashboard_address="127.0.0.1:0",
)


@pytest.fixture(scope="module")
def run() -> Iterator[dict[str, Any]]:
    """One run on a two-worker cluster, inside a span; what the test functions look at."""
    with (
        LocalCluster(n_workers=2, **WITH_WORKER_DASHBOARDS) as cluster,
        Client(cluster) as client,
    ):
        dask_overlap.register(client, **PLUGIN)
        # Persisted first, so that the partition tasks are not fused with the input's.
        x = da.random.random((2000, 64), chunks=(250, 64)).persist()
        y = dask_overlap.map_blocks(double, x, split_axis=0, sub_chunk_bytes="16KiB", out="pinned")
        with span("overlap-metrics-test") as span_id:
            y = y.persist()
            wait(y)
        yield {
            "cluster": cluster,
            "client": client,
            "span_id": span_id,
            "prefix": key_split(y.__dask_keys__()[0][0]),
            "nbytes": x.nbytes,
            "y": y,
        }


def ours(store: dict) -> dict[tuple[str, str], float]:
    """``{(label, unit): value}`` of our execute metrics in a metrics store."""
    out: dict[tuple[str, str], float] = {}
    for k, v in store.items():
        if isinstance(k, tuple) and k[0] == "execute" and str(k[-2]).startswith("overlap-"):
            out[k[-2], k[-1]] = out.get((k[-2], k[-1]), 0) + v
    return out


def test_fine_metrics_reach_the_scheduler(run: dict[str, Any]) -> None:
    sched = run["cluster"].scheduler

    def complete() -> dict | None:
        got = ours(sched.cumulative_worker_metrics)
        return got if got.get(("overlap-d2h", "bytes"), 0) >= run["nbytes"] else None

    got = poll(complete)
    for label in STAGE_LABELS:
        assert got[label, "stream-seconds"] > 0, label
    assert got["overlap-h2d", "bytes"] == got["overlap-d2h", "bytes"] == run["nbytes"]
    assert got["overlap-backpressure", "seconds"] > 0
    assert got["overlap-pinned-fallback", "count"] >= 8  # every output: see PLUGIN
    waits = [v for (label, unit), v in got.items() if unit == "seconds" and label in STAGE_LABELS]
    assert waits and sum(waits) > 0
    # Under the task's prefix, as /individual-fine-performance-metrics groups them.
    keys = [k for k in sched.cumulative_worker_metrics if isinstance(k, tuple)]
    assert ("execute", run["prefix"], "overlap-h2d", "bytes") in keys, run["prefix"]
    # Dask subtracts "seconds" metrics from the thread's time: ours must not overdraw it.
    noncpu = sched.cumulative_worker_metrics[("execute", run["prefix"], "thread-noncpu", "seconds")]
    assert noncpu >= 0


def test_fine_metrics_inside_a_span(run: dict[str, Any]) -> None:
    spans = run["cluster"].scheduler.extensions["spans"]

    def in_span() -> dict | None:
        got = ours(spans.spans[run["span_id"]].cumulative_worker_metrics)
        return got if got.get(("overlap-d2h", "bytes"), 0) >= run["nbytes"] else None

    got = poll(in_span)
    assert got["overlap-h2d", "stream-seconds"] > 0


def test_heartbeat_metrics_reach_the_scheduler(run: dict[str, Any]) -> None:
    sched = run["cluster"].scheduler

    def beats() -> list | None:
        ms = [ws.metrics.get("overlap") for ws in sched.workers.values()]
        return ms if all(m and m["partitions"] for m in ms) else None

    ms = poll(beats)
    assert sum(m["bytes_h2d"] for m in ms) == run["nbytes"]
    for m in ms:
        assert m["in_flight"] == 0 and m["pinned_pool_size"] == 64 * 1024
        for k in ("h2d_bytes_per_second", "d2h_bytes_per_second", "overlap_efficiency"):
            assert isinstance(m[k], float)
        assert m["backpressure_seconds"] >= 0 and m["pinned_fallbacks"] > 0


def test_a_partition_moved_between_workers_shows_in_the_heartbeat(run: dict[str, Any]) -> None:
    """#16: a block computed on one worker and used on the other shows, in the second's
    heartbeat at the scheduler, as a ``transfer`` span with its key and bytes."""
    client, sched = run["client"], run["cluster"].scheduler
    block = client.futures_of(run["y"])[0]
    (holder,) = client.who_has(block)[block.key]
    (other,) = set(sched.workers) - {holder}
    total = client.submit(np.sum, block, workers=[other], pure=False)
    assert total.result() == pytest.approx(float(client.compute(run["y"].blocks[0]).result().sum()))

    def moved() -> dict | None:
        cols = timeline.unpack(sched.workers[other].metrics["overlap"]["recent"])
        rows = [i for i, st in enumerate(cols["stage"]) if st == "transfer"]
        return {c: [cols[c][i] for i in rows] for c in cols} if rows else None

    got = poll(moved)
    assert str(block.key) in got["key"]
    assert set(got["stream"]) == {stages.TRANSFER_LANE}
    assert max(got["nbytes"]) >= run["y"].blocks[0].nbytes


def test_worker_prometheus_endpoint(run: dict[str, Any]) -> None:
    ports = run["client"].run(lambda dask_worker: dask_worker.http_server.port)
    total = 0.0
    for address, port in ports.items():
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            text = r.read().decode()
        series = f'dask_overlap_bytes_total{{direction="h2d",worker="{address}"}}'
        line = next(ln for ln in text.splitlines() if ln.startswith(series))
        total += float(line.split()[-1])
        for name in (
            "in_flight",
            "pinned_in_use_bytes",
            "pinned_pool_size_bytes",
            "stage_overlap_ratio",
            "busy_seconds_total",
            "result_idle_bytes",
        ):
            assert f"dask_overlap_{name}{{" in text, name
        # Every series' unit comes last, as Prometheus names go.
        names = {
            ln.split()[2].removeprefix("dask_overlap_").removesuffix("_total")
            for ln in text.splitlines()
            if ln.startswith("# TYPE dask_overlap_")
        }
        misplaced = {n for n in names if "bytes" in n and not n.endswith(("bytes", "_per_second"))}
        assert "pinned_in_use_bytes" in names and not misplaced, names
    assert total == run["nbytes"]


@pytest.mark.gpu
def test_cuda_partitions_digest_gpu_seconds_and_have_nvtx() -> None:
    cupy = pytest.importorskip("cupy")
    if not cupy.cuda.is_available():
        pytest.skip("no CUDA GPU visible")
    x = da.ones((4096, 1024), chunks=(1024, 1024), dtype="f4")
    y = dask_overlap.map_blocks(double, x, split_axis=0, sub_chunk_bytes="1MiB")
    got: dict[tuple[str, str], float] = {}

    def listen(label: str, value: float, unit: str) -> None:
        got[label, unit] = got.get((label, unit), 0) + value

    # The synchronous scheduler runs tasks in this thread, so this context sees them.
    with dask.config.set({"overlap.backend": "cuda", "scheduler": "sync"}):
        with context_meter.add_callback(listen):
            np.testing.assert_array_equal(y.compute(), 2 * np.ones(x.shape, "f4"))
    for label in ("overlap-h2d", "overlap-compute", "overlap-d2h"):
        assert got[label, "gpu-seconds"] > 0, label
    assert got["overlap-h2d", "bytes"] == got["overlap-d2h", "bytes"] == x.nbytes
    assert nvtx._nvtx() is not None  # CuPy's NVTX, at least


def test_prometheus_series_follow_the_configured_namespace() -> None:
    """Our series are named as distributed names its own: ``<namespace>_<subsystem>_*``,
    with ``distributed.dashboard.prometheus.namespace`` (the workers read it at start)."""
    with (
        dask.config.set({"distributed.dashboard.prometheus.namespace": "ovtest"}),
        LocalCluster(n_workers=1, **WITH_WORKER_DASHBOARDS) as cluster,
        Client(cluster) as client,
    ):
        dask_overlap.register(client, dashboard=False, **PLUGIN)
        x = da.random.random((1000, 64), chunks=(250, 64)).persist()
        wait(dask_overlap.map_blocks(double, x, split_axis=0, sub_chunk_bytes="16KiB").persist())
        ((address, port),) = client.run(lambda dask_worker: dask_worker.http_server.port).items()
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            text = r.read().decode()
    series = f'ovtest_overlap_bytes_total{{direction="h2d",worker="{address}"}}'
    line = next(ln for ln in text.splitlines() if ln.startswith(series))
    assert float(line.split()[-1]) == x.nbytes
    assert "ovtest_worker_threads" in text  # distributed's own, in the same namespace
    assert "dask_overlap_" not in text


# -- sampled stage timing (the lean path on CUDA) -----------------------------------------
def test_the_sampler_times_one_partition_per_period_per_call_and_large_ones_always():
    from dask_overlap.pipeline.sampling import ALWAYS_TIMED_BYTES, SAMPLE_SECONDS, StageSampler

    s = StageSampler()
    spans = [("h2d", 0.0, 1.0, 100), ("compute", 1.0, 3.0, 100), ("d2h", 3.0, 3.5, 50)]
    # Until a partition of the call has been learned, every one is timed.
    assert s.due("a", 100, now=0.0) and s.due("a", 100, now=0.0)
    s.learn("a", spans)
    assert not s.due("a", 100, now=SAMPLE_SECONDS / 2)
    assert s.due("b", 100, now=SAMPLE_SECONDS / 2)  # another call: its own clock
    assert s.due("a", ALWAYS_TIMED_BYTES, now=SAMPLE_SECONDS / 2)
    # A sub-chunk of a partition cut into several is sampled whatever its size.
    assert not s.due("a", ALWAYS_TIMED_BYTES, now=SAMPLE_SECONDS / 2, cut=True)
    assert s.due("a", 100, now=SAMPLE_SECONDS * 1.5)
    assert not s.due("a", 100, now=SAMPLE_SECONDS * 1.6)
    got = s.estimate("a", 10.0, {"h2d": 200, "compute": 200, "d2h": 0})
    assert got == [("h2d", 10.0, 12.0, 200), ("compute", 12.0, 16.0, 200), ("d2h", 16.0, 16.0, 0)]
    assert s.estimate("never learned", 10.0, {"h2d": 1}) == []


def test_the_sampler_forgets_every_call_past_its_bound():
    from dask_overlap.pipeline import sampling

    s = sampling.StageSampler()
    for i in range(sampling._CALLS):
        s.due(i, 1, now=0.0)
        s.learn(i, [("h2d", 0.0, 1.0, 1)])
    assert not s.due(0, 1, now=0.0)
    s.learn("one more", [("h2d", 0.0, 1.0, 1)])  # past the bound: all forgotten
    assert s.due(0, 1, now=0.0) and s.estimate(0, 0.0, {}) == []
    assert s.estimate("one more", 0.0, {}) == [("h2d", 0.0, 1.0, 1)]
