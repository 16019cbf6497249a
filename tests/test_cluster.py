"""The plugin and the cluster helper on real multi-process clusters (host backend, no GPU)."""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import dask
import dask.array as da
import numpy as np
import pytest
from distributed import Client, LocalCluster, Nanny, wait
from support import CLUSTER_KW, plugin, poll

import dask_overlap
from dask_overlap import LocalGPUCluster, Options, OverlapPlugin, runtime_stats
from dask_overlap.cluster.local import (
    CPU_WORKERS,
    THREADS_PER_WORKER,
    WorkerLayout,
    _parse_nvidia_smi,
    parse_devices,
    plan_workers,
    visible_gpus,
)
from dask_overlap.cluster.plugin import resolve_options, worker_runtime


def func(b: np.ndarray) -> np.ndarray:
    return np.sin(b) * 2 + 1


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    with LocalCluster(n_workers=2, threads_per_worker=2, processes=True, **CLUSTER_KW) as cluster:
        yield cluster


@pytest.fixture
def client(cluster: LocalCluster) -> Iterator[Client]:
    """A client with a fresh plugin on every worker (re-registering rebuilds the runtimes)."""
    with Client(cluster) as client:
        client.register_plugin(plugin(pinned_pool_size="64MiB"))
        yield client


def test_results_equal_dask_and_both_workers_share_their_runtime(client: Client) -> None:
    x = da.random.random((4000, 256), chunks=(250, 256))  # 16 partitions of 500 kB
    ours = dask_overlap.map_blocks(func, x, split_axis=0, batch=1, sub_chunk_bytes="64KiB")
    theirs = da.map_blocks(func, x)
    ours, theirs = client.persist([ours, theirs])
    wait([ours, theirs])

    # Every partition ran through its worker's plugin runtime, and both workers ran some.
    where = client.who_has(ours)
    per_worker = {w: 0 for w in client.scheduler_info()["workers"]}
    for holders in where.values():
        (holder,) = holders
        per_worker[holder] += 1
    stats = client.run(runtime_stats)
    assert all(n > 0 for n in per_worker.values()), per_worker
    assert {w: s["partitions"] for w, s in stats.items()} == per_worker
    assert all(s["backend"] == "host" and s["sub_chunks"] > s["partitions"] for s in stats.values())

    got, expected = client.compute([ours, theirs], sync=True)
    np.testing.assert_array_equal(got, expected)


def test_partitions_run_where_their_input_is(client: Client) -> None:
    x = da.random.random((8000, 128), chunks=(250, 128)).persist(scheduler=client)  # 32 chunks
    wait(x)
    x_where = client.who_has(x)
    assert len({w for ws in x_where.values() for w in ws}) == 2, "input should span both workers"

    def transfers(dask_worker: Any) -> tuple[int, int]:
        return (
            dask_worker.state.transfer_incoming_count_total,
            dask_worker.transfer_outgoing_count_total,
        )

    before = client.run(transfers)
    y = dask_overlap.map_blocks(func, x).persist(scheduler=client)
    wait(y)
    after = client.run(transfers)

    assert after == before, f"transfers between workers: before {before}, after {after}"
    y_where = client.who_has(y)
    for xk, yk in zip(sorted(x_where), sorted(y_where), strict=True):
        assert x_where[xk] == y_where[yk], (xk, yk)


def test_teardown_closes_the_pools(client: Client) -> None:
    x = da.random.random((2000, 128), chunks=(250, 128))
    y = dask_overlap.map_blocks(func, x, split_axis=0, sub_chunk_bytes="32KiB")
    client.compute(y.sum(), sync=True)

    def idle(stats: dict[str, dict[str, Any]]) -> bool:
        return all(
            s["in_flight"] == 0 and s["partitions_active"] == 0 and s["pinned_bytes_in_use"] == 0
            for s in stats.values()
        )

    stats = poll(lambda: (s := client.run(runtime_stats)) and idle(s) and s)
    assert sum(s["partitions"] for s in stats.values()) == 8
    assert all(s["pinned_bytes_peak"] > 0 for s in stats.values() if s["partitions"])

    since = time.time()
    client.unregister_worker_plugin(OverlapPlugin.name)

    def teardowns() -> list[dict[str, Any]]:
        return [
            msg
            for t, msg in client.get_events(OverlapPlugin.name)
            if t >= since and msg["action"] == "teardown"
        ]

    events = poll(lambda: len(teardowns()) == 2 and teardowns())
    assert {e["worker"] for e in events} == set(stats)
    assert all(e["closed"] and e["pinned_bytes_in_use"] == 0 for e in events), events
    assert not any(
        client.run(lambda dask_worker: OverlapPlugin.name in dask_worker.plugins).values()
    )

    # With no plugin, tasks fall back to each process's own runtime.
    with dask.config.set({"overlap.backend": "host"}):
        y = dask_overlap.map_blocks(func, x)
    np.testing.assert_array_equal(client.compute(y, sync=True), client.compute(func(x), sync=True))
    assert all(s["partitions"] > 0 for s in client.run(runtime_stats).values())


def test_task_asking_for_another_backend_uses_the_process_runtime(client: Client) -> None:
    x = da.ones((1000, 64), chunks=(250, 64))
    with dask.config.set({"overlap.backend": "timed", "overlap.timed.kernel-seconds": 0.0}):
        y = dask_overlap.map_blocks(func, x)
    np.testing.assert_array_equal(client.compute(y, sync=True), func(np.ones((1000, 64))))

    plugin_stats = client.run(runtime_stats)
    timed_stats = client.run(runtime_stats, "timed")
    assert sum(s["partitions"] for s in plugin_stats.values()) == 0
    assert sum(s["partitions"] for s in timed_stats.values()) == 4
    assert {s["backend"] for s in timed_stats.values()} == {"timed"}


def test_threaded_scheduler_uses_the_process_runtime() -> None:
    x = da.ones((100, 8), chunks=(25, 8))
    y = dask_overlap.map_blocks(func, x, split_axis=0, sub_chunk_bytes=64)
    np.testing.assert_array_equal(y.compute(), func(np.ones((100, 8))))
    assert worker_runtime() is None
    assert runtime_stats()["partitions"] == 4


def _process_partitions() -> dict[str, int]:
    """The partitions each of this process's own runtimes ran (an earlier test's too)."""
    from dask_overlap.pipeline.runtime import process_runtimes

    return {name: rt.counters.partitions for name, rt in process_runtimes().items()}


def test_a_plugin_registered_again_while_partitions_run_leaves_no_runtime_behind(
    client: Client,
) -> None:
    """Between the old plugin's teardown and the new one's setup, partitions wait for the
    new runtime: they fell back to one of the process's own, built from the worker's
    configuration (outside the plugin's bounds) and never closed."""
    x = da.random.default_rng(1).random((2**14, 64), dtype="f4", chunks=(16, 64))
    y = dask_overlap.map_blocks(lambda b: b * 2, x, split_axis=0, batch=1)
    before = client.run(_process_partitions)
    future = client.compute(y)
    poll(lambda: sum(s["partitions"] for s in client.run(runtime_stats).values()) > 50)
    client.register_plugin(plugin(pinned_pool_size="32MiB"))  # while partitions run
    np.testing.assert_array_equal(future.result(), x.compute() * 2)
    pools = client.run(lambda: runtime_stats()["pinned_pool_size"])
    assert set(pools.values()) == {32 * 2**20}
    assert client.run(_process_partitions) == before  # none ran outside the plugin's


def test_cluster_close_closes_each_workers_runtime() -> None:
    # In-process workers share this one plugin object; each still gets its own runtime.
    overlap = plugin(pinned_pool_size="64MiB")
    with (
        LocalCluster(n_workers=2, processes=False, plugins={overlap}, **CLUSTER_KW) as cluster,
        Client(cluster, set_as_default=False) as client,
    ):
        x = da.ones((1000, 64), chunks=(250, 64))
        y = dask_overlap.map_blocks(func, x)
        np.testing.assert_array_equal(client.compute(y, sync=True), func(np.ones((1000, 64))))
        workers = list(cluster.workers.values())
        runtimes = [overlap.runtime(w) for w in workers]
        assert len({id(rt) for rt in runtimes}) == 2 and not any(rt.closed for rt in runtimes)
        assert sum(rt.counters.partitions for rt in runtimes) == 4
    assert all(rt.closed for rt in runtimes)
    assert [overlap.runtime(w) for w in workers] == [None, None]


# --- LocalGPUCluster ----------------------------------------------------------------


def test_local_gpu_cluster_cpu_path() -> None:
    with (
        LocalGPUCluster(
            allow_cpu=True, cuda_visible_devices="", in_flight=3, **CLUSTER_KW
        ) as cluster,
        Client(cluster, set_as_default=False) as client,
    ):
        info = client.run(
            lambda dask_worker: (
                dask_worker.plugins[OverlapPlugin.name].options,
                dask_worker.state.nthreads,
                os.environ.get("CUDA_VISIBLE_DEVICES"),
            )
        )
        expected = Options.from_config(in_flight=3, backend="host")
        # On the CPU path the workers share this machine's cores, as LocalCluster's do.
        threads = max(1, len(os.sched_getaffinity(0)) // CPU_WORKERS)
        assert list(info.values()) == [(expected, threads, None)] * CPU_WORKERS

        x = da.random.random((1000, 64), chunks=(125, 64))
        ours = dask_overlap.map_blocks(func, x, split_axis=0, sub_chunk_bytes="8KiB")
        got, theirs = client.compute([ours, da.map_blocks(func, x)], sync=True)
        np.testing.assert_array_equal(got, theirs)
        # The cluster's in_flight=3 is the workers' window where the call says none.
        windows = client.run(lambda: dask_overlap.runtime_stats()["max_window"])
        assert max(windows.values()) == 3, windows

        # Registered with the scheduler, as a client's register_plugin would do.
        client.unregister_worker_plugin(OverlapPlugin.name)
        left = client.run(lambda dask_worker: OverlapPlugin.name in dask_worker.plugins)
        assert list(left.values()) == [False] * CPU_WORKERS


def test_local_gpu_cluster_gives_each_worker_its_gpu_first() -> None:
    # Device ids are only passed on: the host backend runs, so no GPU is needed.
    with (
        LocalGPUCluster(
            cuda_visible_devices="3,5", threads_per_worker=1, backend="host", **CLUSTER_KW
        ) as cluster,
        Client(cluster, set_as_default=False) as client,
    ):
        envs = client.run(
            lambda dask_worker: (dask_worker.name, os.environ["CUDA_VISIBLE_DEVICES"])
        )
        assert sorted(envs.values()) == [(0, "3,5"), (1, "5,3")]
        cluster.scale(3)
        client.wait_for_workers(3, timeout=60)
        envs = client.run(
            lambda dask_worker: (
                dask_worker.name,
                os.environ["CUDA_VISIBLE_DEVICES"],
                dask_worker.state.nthreads,
                OverlapPlugin.name in dask_worker.plugins,
            )
        )
        assert sorted(envs.values()) == [
            (0, "3,5", 1, True),
            (1, "5,3", 1, True),
            (2, "3,5", 1, True),
        ]


def test_local_gpu_cluster_without_gpu_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    with pytest.raises(RuntimeError, match="no GPU is visible.*allow_cpu=True"):
        LocalGPUCluster(**CLUSTER_KW)
    with pytest.raises(ValueError, match="backend='cuda'.*no GPU is visible.*'auto'") as info:
        LocalGPUCluster(allow_cpu=True, backend="cuda", **CLUSTER_KW)
    assert "allow_cpu" not in str(info.value)  # given already: not what to do
    with pytest.raises(ValueError, match="in_flight must be a positive integer, got 0"):
        LocalGPUCluster(allow_cpu=True, in_flight=0, **CLUSTER_KW)
    with pytest.raises(ValueError, match="processes=False"):
        LocalGPUCluster(allow_cpu=True, processes=False, **CLUSTER_KW)
    # Read where a graph is optimized (the client), never by a worker: refused, not ignored.
    with pytest.raises(ValueError, match=r"fuse is read where a graph is optimized.*overlap\.fuse"):
        LocalGPUCluster(allow_cpu=True, fuse=False, **CLUSTER_KW)


@pytest.mark.parametrize(
    "kw, message",
    [
        ({"threads_per_worker": 0}, "threads_per_worker must be a positive integer, got 0"),
        ({"threads_per_worker": "2"}, "threads_per_worker must be a positive integer, got '2'"),
        ({"threads_per_worker": 1.5}, "threads_per_worker must be a positive integer"),
        ({"memory_limit": "lots"}, "memory_limit must be 'auto', a byte count .*got 'lots'"),
        ({"memory_limit": "-1GiB"}, "memory_limit must be .*got '-1GiB'"),
        ({"memory_limit": True}, "memory_limit must be .*got True"),
    ],
)
def test_local_gpu_cluster_checks_its_arguments_before_starting(
    kw: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        LocalGPUCluster(allow_cpu=True, cuda_visible_devices="", **kw, **CLUSTER_KW)


class _NannyThatFails(Nanny):
    async def start_unsafe(self) -> Any:
        raise OSError("this nanny does not start")


def test_a_worker_that_fails_to_start_fails_the_cluster() -> None:
    # It came up with no worker before, the failure only logged: work then waited forever.
    with pytest.raises(RuntimeError, match="failed to start") as info:
        LocalGPUCluster(allow_cpu=True, n_workers=1, worker_class=_NannyThatFails, **CLUSTER_KW)
    assert "this nanny does not start" in str(info.value.__cause__)


# --- layout and options, no cluster -------------------------------------------------


def test_threads_per_worker_default_to_four_per_gpu() -> None:
    """The advice (about four partitions in flight per GPU) is the default everywhere."""
    assert THREADS_PER_WORKER == 4
    gpus = plan_workers(cuda_visible_devices="0,1", options=Options.from_config(backend="host"))
    assert gpus.threads_per_worker == THREADS_PER_WORKER
    cpu = plan_workers(cuda_visible_devices="", allow_cpu=True)
    assert cpu.threads_per_worker == max(1, len(os.sched_getaffinity(0)) // cpu.n_workers)
    assert WorkerLayout(64, (), cpu.options).threads_per_worker == 1  # never below one


def test_parse_devices_and_visible_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    assert parse_devices(" 0, 2 ,1") == ["0", "2", "1"]
    assert parse_devices("1,-1,2") == ["1"]
    assert parse_devices("") == []
    assert parse_devices([0, "GPU-ab"]) == ["0", "GPU-ab"]
    assert parse_devices(1) == ["1"]  # one index, as a user may write it
    with pytest.raises(TypeError, match="cuda_visible_devices must be .*got 1.5"):
        parse_devices(1.5)  # type: ignore[arg-type]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-1,GPU-2")
    assert visible_gpus() == ["GPU-1", "GPU-2"]
    smi = (
        "GPU 0: NVIDIA H200 (UUID: GPU-1)\n"
        "  MIG 1g.18gb     Device  0: (UUID: MIG-1)\n"
        "GPU 1: NVIDIA H200 (UUID: GPU-2)\n"
    )
    assert _parse_nvidia_smi(smi) == ["0", "1"]


def test_worker_layout_rotates_devices() -> None:
    opts = Options.from_config(backend="host")
    layout = WorkerLayout(4, ("0", "1", "2"), opts)
    envs = [layout.env(i)["CUDA_VISIBLE_DEVICES"] for i in range(4)]
    assert envs == ["0,1,2", "1,2,0", "2,0,1", "0,1,2"]
    assert WorkerLayout(2, ("0", "0"), opts).env(1) == {"CUDA_VISIBLE_DEVICES": "0"}
    assert WorkerLayout(2, (), opts).env(1) == {}


def test_plan_workers() -> None:
    cpu = plan_workers(cuda_visible_devices="", allow_cpu=True)
    assert (cpu.n_workers, cpu.devices, cpu.options.backend) == (CPU_WORKERS, (), "host")
    timed = plan_workers(
        3, cuda_visible_devices="-1", allow_cpu=True, options=resolve_options(backend="timed")
    )
    assert (timed.n_workers, timed.options.backend) == (3, "timed")
    with pytest.raises(ValueError, match="n_workers must be a positive integer, got 0"):
        plan_workers(0, cuda_visible_devices="", allow_cpu=True)
    with pytest.raises(RuntimeError, match="given as ''"):
        plan_workers(cuda_visible_devices="")
    host = plan_workers(cuda_visible_devices="0,1", options=resolve_options(backend="host"))
    assert (host.n_workers, host.devices, host.options.backend) == (2, ("0", "1"), "host")
    if importlib.util.find_spec("cupy") is None:
        with pytest.raises(ImportError, match=r"CuPy is not installed.*dask_overlap\[cuda13\]"):
            plan_workers(cuda_visible_devices="0")
    else:
        assert plan_workers(cuda_visible_devices="0").options.backend == "cuda"


def test_plugin_options_from_config_and_from_arguments_agree() -> None:
    settings = {"overlap.in-flight": 3, "overlap.pinned-pool-size": "64MiB", "overlap.streams": 2}
    with dask.config.set(settings):
        from_config = OverlapPlugin().options
        assert from_config == Options.from_config()
    from_args = OverlapPlugin(in_flight=3, pinned_pool_size="64MiB", streams=2).options
    assert from_args == from_config
    assert OverlapPlugin(from_config).options is from_config
    assert OverlapPlugin(from_config, in_flight=5).options == dataclasses.replace(
        from_config, in_flight=5
    )
    assert plan_workers(
        cuda_visible_devices="", allow_cpu=True, options=from_args
    ).options == dataclasses.replace(from_config, backend="host")


def test_plugin_validates_on_the_client() -> None:
    with pytest.raises(ValueError, match="in_flight must be a positive integer, got 0"):
        OverlapPlugin(in_flight=0)
    with pytest.raises(ValueError, match="pinned_pool_size.*got 'lots'"):
        OverlapPlugin(pinned_pool_size="lots")
    with pytest.raises(TypeError, match=r"unknown option\(s\) \['in_flite'\]"):
        OverlapPlugin(in_flite=2)
    with pytest.raises(TypeError, match="options must be a dask_overlap.Options, got dict"):
        OverlapPlugin({"in_flight": 2})  # type: ignore[arg-type]


# --- on a GPU (pytest -m gpu; skipped where none is visible) -------------------------
GPU_OPTIONS: dict[str, Any] = dict(pinned_pool_size="256MiB", device_pool_size="2GiB")


def affine(b: Any) -> Any:
    return b * 2 + 1  # NumPy and CuPy blocks alike


@pytest.mark.gpu
def test_local_gpu_cluster_one_worker_per_gpu() -> None:
    gpus = visible_gpus()
    with (
        LocalGPUCluster(**GPU_OPTIONS, **CLUSTER_KW) as cluster,
        Client(cluster, set_as_default=False) as client,
    ):
        envs = client.run(lambda: os.environ["CUDA_VISIBLE_DEVICES"].split(","))
        assert sorted(e[0] for e in envs.values()) == sorted(gpus)

        x = da.random.random((1 << 16, 256), chunks=(1 << 13, 256)).astype(np.float32)
        ours = dask_overlap.map_blocks(affine, x, split_axis=0, sub_chunk_bytes="1MiB")
        got, theirs = client.compute([ours, da.map_blocks(affine, x)], sync=True)
        np.testing.assert_array_equal(got, theirs)
        stats = client.run(runtime_stats)
        assert {s["backend"] for s in stats.values()} == {"cuda"}
        assert sum(s["partitions"] for s in stats.values()) == 8

        since = time.time()
        client.unregister_worker_plugin(OverlapPlugin.name)
        events = poll(
            lambda: (
                [
                    m
                    for t, m in client.get_events(OverlapPlugin.name)
                    if t >= since and m["action"] == "teardown"
                ]
                or None
            )
        )
        assert all(e["closed"] and e["in_flight"] == 0 for e in events), events


@pytest.mark.gpu
def test_two_workers_on_one_gpu() -> None:
    gpu = visible_gpus()[0]
    with (
        LocalGPUCluster(2, cuda_visible_devices=gpu, **GPU_OPTIONS, **CLUSTER_KW) as cluster,
        Client(cluster, set_as_default=False) as client,
    ):
        envs = client.run(lambda: os.environ["CUDA_VISIBLE_DEVICES"])
        assert list(envs.values()) == [gpu, gpu]
        x = da.random.random((1 << 16, 256), chunks=(1 << 12, 256)).astype(np.float32)
        ours = dask_overlap.map_blocks(affine, x, split_axis=0, sub_chunk_bytes="1MiB")
        got, theirs = client.compute([ours, da.map_blocks(affine, x)], sync=True)
        np.testing.assert_array_equal(got, theirs)
        stats = client.run(runtime_stats)
        assert all(s["backend"] == "cuda" and s["partitions"] > 0 for s in stats.values())


# A client with no bokeh (an install without the dashboard extra): bokeh's import fails.
NO_BOKEH_SCRIPT = """
import json, logging, sys, urllib.request
sys.modules["bokeh"] = None
from distributed import Client
from dask_overlap import LocalGPUCluster

if __name__ == "__main__":
    if sys.argv[1:] == ["debug"]:
        logging.basicConfig(level=logging.WARNING)
        logging.getLogger("dask_overlap").setLevel(logging.DEBUG)
    for _ in range(2):
        with (
            LocalGPUCluster(allow_cpu=True, cuda_visible_devices="", n_workers=1,
                            threads_per_worker=1, dashboard_address="127.0.0.1:0") as cluster,
            Client(cluster),
        ):
            url = cluster.dashboard_link.rsplit("/", 1)[0] + "/overlap.json"
            with urllib.request.urlopen(url, timeout=30) as answer:
                print("overlap.json:", answer.status, type(json.load(answer)).__name__)
"""


@pytest.mark.parametrize("mode", ["default", "debug"])
def test_no_bokeh_is_not_said_on_every_cluster(mode: str, tmp_path: Any) -> None:
    script = tmp_path / "no_bokeh.py"
    script.write_text(NO_BOKEH_SCRIPT)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run(
        [sys.executable, str(script), mode], cwd=tmp_path, env=env, capture_output=True,
        text=True, timeout=240,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    # The page's JSON twin is served all the same.
    assert done.stdout.count("overlap.json: 200 dict") == 2, done.stdout + done.stderr[-3000:]
    said = done.stderr.count("no /overlap page without bokeh")
    # At debug level only: nothing by default, once per cluster where debug is asked for.
    assert said == (2 if mode == "debug" else 0), done.stderr[-3000:]
