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
from support import poll

import dask_overlap
from dask_overlap import LocalGPUCluster, OverlapSchedulerPlugin
from dask_overlap.dashboard import OverlapView, register_with_scheduler, render_html

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


def run_once(client: Client) -> int:
    x = da.random.random((2000, 64), chunks=(250, 64)).persist()
    y = dask_overlap.map_blocks(double, x, split_axis=0, sub_chunk_bytes="16KiB").persist()
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
    for w in snap["workers"].values():
        assert w["bytes_h2d"] > 0 and w["bytes_d2h"] > 0, w
        assert len(w["timeline"]["start"]) > 0
        assert {"pinned_bytes_in_use", "pinned_pool_size", "device_bytes_in_use"} <= set(w)
        assert {"in_flight", "window_capacity", "backpressure_seconds"} <= set(w)


@pytest.fixture(scope="module")
def plain() -> Iterator[tuple[LocalCluster, Client, int]]:
    with LocalCluster(**CLUSTER) as cluster, Client(cluster) as client:
        dask_overlap.register(client, **PLUGIN)
        yield cluster, client, run_once(client)


def base_url(cluster: LocalCluster, prefix: str = "") -> str:
    return f"http://127.0.0.1:{cluster.scheduler.http_server.port}{prefix}"


def test_page_and_json(plain: tuple[LocalCluster, Client, int]) -> None:
    cluster, _, nbytes = plain
    base = base_url(cluster)
    check_page(base)
    check_snapshot(full_snapshot(base, cluster, nbytes), cluster)


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
        nbytes = run_once(client)
        base = base_url(cluster, "/dask")
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
        nbytes = run_once(client)
        check_snapshot(full_snapshot(base_url(cluster), cluster, nbytes), cluster)


def test_plugin_checks_its_arguments() -> None:
    with pytest.raises(ValueError, match="window must be"):
        OverlapSchedulerPlugin(window=0)
    with pytest.raises(ValueError, match="interval must be"):
        OverlapSchedulerPlugin(interval=1)
    with pytest.raises(ValueError, match="link_bandwidth"):
        OverlapSchedulerPlugin(link_bandwidth="fast")
    assert OverlapSchedulerPlugin(link_bandwidth="25GB").link_bandwidth == 25e9


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
    view.update({"time": 0.0, "window": 10.0, "workers": {}})  # the worker left
    assert view.panels == {} and view.timeline_source.data["left"] == []
    out = render_html(synthetic(), str(tmp_path / "overlap.html"))
    assert "overlap-timeline" in Path(out).read_text()


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
        nbytes = run_once(client)
        base = base_url(cluster)
        check_snapshot(full_snapshot(base, cluster, nbytes), cluster)
        assert get(f"{base}/overlap")[0] == 404  # no page, and no error either
        assert cluster.scheduler.plugins["overlap-dashboard"].app is None
