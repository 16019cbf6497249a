"""The scheduler's ``/overlap`` page and ``/overlap.json``, with and without a prefix."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import dask.array as da
import numpy as np
import pytest
from distributed import Client, LocalCluster, wait
from support import needs_install, poll

import dask_overlap
from dask_overlap import LocalGPUCluster, OverlapSchedulerPlugin
from dask_overlap.dashboard import OverlapView, register_with_scheduler, render_html
from dask_overlap.dashboard.history import Histories, WorkerHistory
from dask_overlap.metrics.timeline import COLUMNS, pack
from dask_overlap.metrics.worker import TIMELINE_HANDLER

PLUGIN = dict(backend="host", pinned_pool_size="64MiB", in_flight=2, streams=2)
CLUSTER = dict(
    n_workers=2,
    threads_per_worker=2,
    processes=True,
    dashboard_address="127.0.0.1:0",
    worker_dashboard_address=None,
)


def get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=20) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, ""


def double(b: np.ndarray) -> np.ndarray:
    return b * 2


def run_watched(client: Client, base: str, cluster: LocalCluster) -> int:
    """Run a job while reading ``/overlap.json`` as an open page would, until every
    worker's heartbeats have brought all its bytes and some spans; the bytes moved in.

    The scheduler gathers spans from heartbeats only while someone reads them, and each
    heartbeat carries the last two seconds of activity, for ten seconds after it: hence
    reading from the start."""
    x = da.random.random((2000, 64), chunks=(250, 64)).persist()
    wait(x)
    y = dask_overlap.map_blocks(double, x, split_axis=0, sub_chunk_bytes="16KiB").persist()

    def ready() -> bool:
        status, body = get(f"{base}/overlap.json")
        assert status == 200, status
        workers = json.loads(body)["workers"]
        return (
            set(workers) == set(cluster.scheduler.workers)
            and sum(w["bytes_h2d"] for w in workers.values()) == x.nbytes
            and all(w["timeline"]["start"] for w in workers.values())
        )

    poll(ready)
    wait(y)
    return x.nbytes


def full_snapshot(base: str, cluster: LocalCluster, nbytes: int) -> dict[str, Any]:
    """``/overlap.json`` once every worker is in it and all bytes are counted."""

    def ready() -> dict | None:
        status, body = get(f"{base}/overlap.json")
        assert status == 200, status
        snap = json.loads(body)
        workers = snap["workers"]
        if set(workers) != set(cluster.scheduler.workers):
            return None
        return snap if sum(w["bytes_h2d"] for w in workers.values()) == nbytes else None

    return poll(ready)


def check_page(base: str) -> None:
    status, body = get(f"{base}/overlap")
    assert status == 200
    assert "bokeh" in body.lower() and "static/js/bokeh" in body  # a Bokeh server document
    assert 'href="overlap"' in body  # its own tab in the navigation bar
    status, body = get(f"{base}/status")
    assert status == 200 and 'href="overlap"' in body  # and in Dask's pages


def check_snapshot(snap: dict[str, Any], cluster: LocalCluster) -> None:
    assert snap["link_bandwidth"] == 55e9  # overlap.link-bandwidth
    assert set(snap["workers"]) == set(cluster.scheduler.workers)
    assert snap["detail"] is False
    for w in snap["workers"].values():
        assert w["bytes_h2d"] > 0 and w["bytes_d2h"] > 0, w
        # What the page gathered during the run stays after it.
        assert len(w["timeline"]["start"]) > 0 and w["timeline_source"] == "heartbeats"
        assert set(w["timeline"]) == set(COLUMNS)
        assert len(w["rates"]["time"]) == len(w["rates"]["h2d"]) > 0
        assert "recent" not in w  # the heartbeat's packed spans are unpacked into timeline
        assert {"pinned_bytes_in_use", "pinned_pool_size", "device_bytes_in_use"} <= set(w)
        assert {"in_flight", "window_capacity", "backpressure_seconds"} <= set(w)
        # The result pool's bar and numbers: its bound, what it holds, results made.
        assert {"result_bytes_idle", "result_pool_size", "results_reused", "results_fresh"} <= set(
            w
        )


def count_timeline_calls(dask_worker: Any) -> None:
    """Count the calls of a worker's timeline handler (the one RPC the dashboard has)."""
    handler = dask_worker.handlers[TIMELINE_HANDLER]
    calls = dask_worker.overlap_timeline_calls = []

    def counted(**kwargs: Any) -> Any:
        calls.append(kwargs)
        return handler(**kwargs)

    dask_worker.handlers[TIMELINE_HANDLER] = counted


def timeline_calls(dask_worker: Any) -> int:
    return len(dask_worker.overlap_timeline_calls)


@pytest.fixture(scope="module")
def plain() -> Iterator[tuple[LocalCluster, Client, int]]:
    with LocalCluster(**CLUSTER) as cluster, Client(cluster) as client:
        dask_overlap.register(client, **PLUGIN)
        client.run(count_timeline_calls)
        yield cluster, client, run_watched(client, base_url(cluster), cluster)


def base_url(cluster: LocalCluster, prefix: str = "") -> str:
    return f"http://127.0.0.1:{cluster.scheduler.http_server.port}{prefix}"


def test_page_and_json(plain: tuple[LocalCluster, Client, int]) -> None:
    cluster, _, nbytes = plain
    base = base_url(cluster)
    check_page(base)
    check_snapshot(full_snapshot(base, cluster, nbytes), cluster)


def test_json_comes_from_heartbeats_not_requests_to_workers(
    plain: tuple[LocalCluster, Client, int],
) -> None:
    """#14: the page and ``/overlap.json`` read what heartbeats brought; only
    ``?detail=1`` asks the workers, once each per request."""
    cluster, client, nbytes = plain
    base = base_url(cluster)
    check_page(base)
    snap = full_snapshot(base, cluster, nbytes)  # after the whole run was read, above
    assert client.run(timeline_calls) == dict.fromkeys(cluster.scheduler.workers, 0)
    for address, w in snap["workers"].items():
        beat = cluster.scheduler.workers[address].metrics["overlap"]
        assert w["bytes_h2d"] == beat["bytes_h2d"] and w["partitions"] == beat["partitions"]
    status, body = get(f"{base}/overlap.json?detail=1")
    assert status == 200
    detail = json.loads(body)
    assert detail["detail"] is True
    assert {w["timeline_source"] for w in detail["workers"].values()} == {"worker"}
    assert not any("rates" in w for w in detail["workers"].values())  # the page bins them
    assert sum(w["bytes_h2d"] for w in detail["workers"].values()) == nbytes
    assert client.run(timeline_calls) == dict.fromkeys(cluster.scheduler.workers, 1)


def test_register_is_idempotent(plain: tuple[LocalCluster, Client, int]) -> None:
    cluster, client, _ = plain
    app = cluster.scheduler.plugins["overlap-dashboard"].app
    client.register_plugin(OverlapSchedulerPlugin())
    assert asyncio.run(register_with_scheduler(cluster.scheduler_address))
    assert cluster.scheduler.plugins["overlap-dashboard"].app is app
    apps = cluster.scheduler.http_application.applications
    assert sum(a is app for a in apps) == 1


def test_fine_performance_metrics_page_shows_our_activities(
    plain: tuple[LocalCluster, Client, int],
) -> None:
    from distributed.dashboard.components.scheduler import FinePerformanceMetrics

    cluster, _, _ = plain
    assert get(f"{base_url(cluster)}/individual-fine-performance-metrics")[0] == 200

    def component() -> Any:
        fpm = FinePerformanceMetrics(cluster.scheduler)
        fpm.update()
        return fpm if "overlap-backpressure" in fpm.visible_activities else None

    fpm = poll(component)  # the run is over: the scheduler's state holds still
    assert {"stream-seconds", "bytes", "count"} <= set(fpm.unit_selector.options)
    assert "double" in fpm.function_selector.options  # under the task's prefix


def test_under_a_dashboard_prefix() -> None:
    with (
        LocalCluster(**CLUSTER, scheduler_kwargs={"http_prefix": "/dask"}) as cluster,
        Client(cluster) as client,
    ):
        dask_overlap.register(client, **PLUGIN)
        base = base_url(cluster, "/dask")
        nbytes = run_watched(client, base, cluster)
        check_page(base)
        check_snapshot(full_snapshot(base, cluster, nbytes), cluster)
        assert get(f"{base_url(cluster)}/overlap")[0] == 404
        # Closing the plugin takes the page and its tab away again.
        cluster.sync(cluster.scheduler.plugins["overlap-dashboard"].close)
        assert get(f"{base}/overlap")[0] == 404
        assert 'href="overlap"' not in get(f"{base}/status")[1]


def test_local_gpu_cluster_sets_everything_up() -> None:
    with (
        LocalGPUCluster(
            n_workers=1,
            allow_cpu=True,
            cuda_visible_devices="",
            dashboard_address="127.0.0.1:0",
            pinned_pool_size="64MiB",
        ) as cluster,
        Client(cluster) as client,
    ):
        assert "overlap-dashboard" in cluster.scheduler.plugins
        nbytes = run_watched(client, base_url(cluster), cluster)
        check_snapshot(full_snapshot(base_url(cluster), cluster, nbytes), cluster)


def test_plugin_checks_its_arguments() -> None:
    with pytest.raises(ValueError, match="timeline_seconds must be"):
        OverlapSchedulerPlugin(timeline_seconds=0)
    with pytest.raises(ValueError, match="interval must be"):
        OverlapSchedulerPlugin(interval=1)
    with pytest.raises(ValueError, match="link_bandwidth"):
        OverlapSchedulerPlugin(link_bandwidth="fast")
    assert OverlapSchedulerPlugin(link_bandwidth="25GB").link_bandwidth == 25e9
    with pytest.raises(ValueError, match="link_bandwidth"):
        OverlapSchedulerPlugin(link_bandwidth=float("inf"))
    for seconds in ("10", float("nan"), float("inf"), True):
        with pytest.raises(ValueError, match="timeline_seconds must be .*got"):
            OverlapSchedulerPlugin(timeline_seconds=seconds)  # type: ignore[arg-type]
    for limit in (0, -5, "many"):
        with pytest.raises(ValueError, match="timeline_limit must be a positive integer, got"):
            OverlapSchedulerPlugin(timeline_limit=limit)  # type: ignore[arg-type]


def synthetic(n: int = 6) -> dict[str, Any]:
    t0 = 1_700_000_000.0
    tl: dict[str, list] = {k: [] for k in ("key", "sub_chunk", "stream", "stage")}
    tl.update(start=[], end=[], nbytes=[])
    for i in range(n):
        for j, stage in enumerate(("h2d", "compute", "d2h")):
            tl["key"].append("('f-1', 0)")
            tl["sub_chunk"].append(i)
            tl["stream"].append(i % 2)
            tl["stage"].append(stage)
            tl["start"].append(t0 + 0.01 * (i + j))
            tl["end"].append(t0 + 0.01 * (i + j + 1))
            tl["nbytes"].append(2**20)
    worker = dict(streams=2, bytes_h2d=n * 2**20, pinned_pool_size=2**30, timeline=tl)
    return {"time": t0 + 1, "window": 10.0, "link_bandwidth": 55e9, "workers": {"w": worker}}


def test_view_and_static_render(tmp_path: Path) -> None:
    view = OverlapView(55e9)
    view.update(synthetic())
    assert len(view.timeline_source.data["left"]) == 18
    assert set(view.timeline_source.data["color"]) == {"#1f77b4", "#2ca02c", "#ff7f0e"}
    rates = view.panels["w"].rate_source.data
    # Every byte copied lands in some bin: rate x bin width sums to the bytes moved.
    width = (rates["time"][1] - rates["time"][0]) / 1000
    assert sum(rates["h2d"]) * width * 1e9 == pytest.approx(6 * 2**20)
    view.update({"time": 0.0, "timeline_seconds": 10.0, "workers": {}})  # the worker left
    assert view.panels == {} and view.timeline_source.data["left"] == []
    out = render_html(synthetic(), str(tmp_path / "overlap.html"))
    assert "overlap-timeline" in Path(out).read_text()
    assert "link ceiling 55.0 GB/s" in Path(out).read_text()  # the snapshot's own
    out = render_html(synthetic(), str(tmp_path / "asked.html"), link_bandwidth="25GB")
    assert "link ceiling 25.0 GB/s" in Path(out).read_text()  # one asked for wins


def test_transfers_in_have_a_lane_of_their_own() -> None:
    """#16: a partition moved in from another worker is drawn beside the streams, on its
    own lane and in its own colour, and counts in neither copy rate."""
    snap = synthetic()
    tl = snap["workers"]["w"]["timeline"]
    t0 = tl["start"][0]
    for c, v in dict(key="('y', 5)", sub_chunk=1, stream=-2, stage="transfer").items():
        tl[c].append(v)
    tl["start"].append(t0 - 0.05)
    tl["end"].append(t0)
    tl["nbytes"].append(2**24)
    view = OverlapView(55e9)
    view.update(snap)
    rows = view.timeline_source.data
    i = rows["stage"].index("transfer")
    assert rows["stage_name"][i] == "transfer in" and rows["color"][i] == "#9467bd"
    labels = view.panels["w"].timeline.yaxis.major_label_overrides
    assert labels == {-2: "transfers in", -1: "copy threads", 0: "stream 0", 1: "stream 1"}
    rates = view.panels["w"].rate_source.data
    width = (rates["time"][1] - rates["time"][0]) / 1000
    assert sum(rates["h2d"]) * width * 1e9 == pytest.approx(6 * 2**20, rel=1e-3)  # not 16 MiB
    assert "transfer in" in view.header.text


def test_view_plots_the_rates_heartbeats_reported() -> None:
    snap = synthetic()
    t0 = snap["time"] - 1
    snap["workers"]["w"]["rates"] = {"time": [t0, t0 + 0.5], "h2d": [2e9, 4e9], "d2h": [0.0, 1e9]}
    view = OverlapView(55e9)
    view.update(snap)
    rates = view.panels["w"].rate_source.data
    assert rates == {"time": [t0 * 1000, (t0 + 0.5) * 1000], "h2d": [2.0, 4.0], "d2h": [0.0, 1.0]}
    assert "from the workers' heartbeats" in view.header.text


def beat(t: float, spans: list[tuple[int, str, float, float]], h2d: float = 1e9) -> dict:
    """A heartbeat entry at worker time ``t`` carrying ``(sub_chunk, stage, start, end)``."""
    from dask_overlap.pipeline.runtime import Span

    packed = pack([Span(("f", 0), i, 0, st, a, b, 10) for i, st, a, b in spans])
    return {"time": t, "h2d_bytes_per_second": h2d, "d2h_bytes_per_second": 0.0, "recent": packed}


def test_history_merges_overlapping_heartbeats_once() -> None:
    h = WorkerHistory(seconds=10.0, limit=100)
    first = beat(2.0, [(0, "h2d", 0.0, 1.0), (0, "compute", 1.0, 1.5)])
    h.merge(first)
    h.merge(first)  # read twice before the next heartbeat: merged once
    h.merge(beat(2.5, [(0, "compute", 1.0, 1.5), (1, "h2d", 1.5, 2.4)]))  # overlaps the first
    t = h.timeline()
    assert list(zip(t["sub_chunk"], t["stage"], strict=True)) == [
        (0, "h2d"),
        (0, "compute"),
        (1, "h2d"),
    ]
    assert t["key"] == ["('f', 0)"] * 3
    assert h.rates()["time"] == [2.0, 2.5]


def test_history_keeps_the_last_seconds_of_activity_and_the_newest_spans() -> None:
    h = WorkerHistory(seconds=10.0, limit=3)
    h.merge(beat(1.0, [(i, "h2d", 0.1 * i, 0.1 * i + 0.1) for i in range(5)]))
    assert h.timeline()["sub_chunk"] == [2, 3, 4]  # the newest three
    # Long after the run, with nothing new: its spans stay, and idle rates do not pile up.
    for t in range(2, 100):
        h.merge(beat(float(t), [], h2d=0.0))
    assert h.timeline()["sub_chunk"] == [2, 3, 4]
    assert h.rates()["time"] == [1.0, 2.0]  # within the averaging interval of the last span
    # A new run pushes the old one out.
    h.merge(beat(100.0, [(9, "d2h", 99.0, 99.5)]))
    assert h.timeline()["sub_chunk"] == [9]


class FakeWorkerState:
    def __init__(self, address: str, metrics: dict) -> None:
        self.address = address
        self.metrics = metrics


def test_histories_follow_the_workers_that_report() -> None:
    hs = Histories(seconds=10.0, limit=10)
    a = FakeWorkerState("tcp://a:1", {"overlap": beat(1.0, [(0, "h2d", 0.0, 0.5)])})
    b = FakeWorkerState("tcp://b:1", {})  # no OverlapPlugin there
    got = hs.update([b, a])
    assert [ws.address for ws, _ in got] == ["tcp://a:1"]
    assert got[0][1].timeline()["end"] == [0.5]
    assert hs.update([b]) == []
    assert hs.update([a])[0][1].timeline()["end"] == [0.5]  # from its heartbeat again


@needs_install
def test_cli_worker_adds_the_page(tmp_path: Path) -> None:
    with LocalCluster(n_workers=0, dashboard_address="127.0.0.1:0") as cluster:
        assert "overlap-dashboard" not in cluster.scheduler.plugins
        cmd = [sys.executable, "-m", "dask", "overlap", "worker", cluster.scheduler_address]
        cmd += ["--allow-cpu", "--cuda-visible-devices", "", "--n-workers", "1"]
        cmd += ["--no-dashboard", "--local-directory", str(tmp_path)]
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            poll(lambda: "overlap-dashboard" in cluster.scheduler.plugins, timeout=60)
            assert get(f"{base_url(cluster)}/overlap")[0] == 200
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def test_json_is_served_without_bokeh(monkeypatch) -> None:
    """#14 item 3: the page needs bokeh, ``/overlap.json`` does not. Here the import of
    Dask's Bokeh application fails, as it does where bokeh is not installed."""
    with LocalCluster(**CLUSTER) as cluster, Client(cluster) as client:
        monkeypatch.setitem(sys.modules, "distributed.dashboard.core", None)
        dask_overlap.register(client, **PLUGIN)
        base = base_url(cluster)
        nbytes = run_watched(client, base, cluster)
        check_snapshot(full_snapshot(base, cluster, nbytes), cluster)
        assert get(f"{base}/overlap")[0] == 404  # no page, and no error either
        assert cluster.scheduler.plugins["overlap-dashboard"].app is None
