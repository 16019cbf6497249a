"""The CPU path makes no copy that only a device needs: where every partition runs on the
host backend, ``batch="auto"`` joins no blocks and ``sub-chunk-bytes: auto`` cuts no
partition (an explicit size still cuts). The client tells where partitions will run
(:mod:`dask_overlap.graph.placement`) from the scheduler it will use: this process for the
threaded scheduler, the workers for a distributed client."""

from __future__ import annotations

import dask
import dask.array as da
import numpy as np
import pytest
from distributed import Client, LocalCluster
from support import poll, task_prefixes, wait_until_idle

import dask_overlap
from dask_overlap import LocalGPUCluster, Options
from dask_overlap.graph import batch, placement
from dask_overlap.pipeline import layout


@pytest.fixture
def small_batches(monkeypatch: pytest.MonkeyPatch) -> None:
    """Sizes at which a device would join the tests' blocks of a few KiB (four to a
    partition) and cut their partitions (in four)."""
    monkeypatch.setattr(batch, "AUTO_MIN_PARTITIONS", 1)
    monkeypatch.setattr(batch, "AUTO_MIN_BYTES", 4 * 10 * 8 * 8)
    monkeypatch.setattr(layout, "AUTO_MIN_BYTES", 1024)


@pytest.fixture
def host() -> None:
    """The host backend, also on a machine with a GPU."""
    with dask.config.set({"overlap.backend": "host"}):
        yield


def rows(n: int = 120, cols: int = 8) -> np.ndarray:
    return np.arange(n * cols, dtype=np.float64).reshape(n, cols)


# -- the client's view ---------------------------------------------------------------------
def test_a_backend_named_is_where_the_partitions_run():
    assert placement.placement("host").on_host
    assert placement.placement("cuda").backends == {"cuda"}
    assert not placement.placement("timed").on_host  # a device, modelled


def test_the_threaded_scheduler_runs_them_in_this_process():
    assert placement.placement("auto").backends == {dask_overlap.get_runtime().name}
    with dask.config.set(scheduler="sync"):
        assert placement.placement("auto").backends == {dask_overlap.get_runtime().name}


def test_a_scheduler_it_does_not_know_leaves_it_unknown():
    with dask.config.set(scheduler=dask.get):  # a get function: where it runs is its own
        where = placement.placement("auto")
    assert where.backends == frozenset() and not where.on_host


def test_every_worker_must_be_on_the_host():
    def worker(backend: str) -> dict:
        return {"metrics": {"overlap": {"backend": backend}}}

    both = {"a": worker("host"), "b": worker("cuda")}
    assert placement._workers_backends(both) == {"host", "cuda"}
    assert placement.Placement(frozenset({"host", "cuda"})).on_host is False
    assert placement._workers_backends({"a": worker("host")}) == {"host"}
    assert placement._workers_backends({}) == frozenset()  # no workers yet: not known


# -- on the host backend -------------------------------------------------------------------
def test_auto_keeps_one_partition_per_block(host, small_batches):
    a = rows()
    x = da.from_array(a, chunks=(10, 8))  # 12 blocks, joined four to one on a device
    y = dask_overlap.map_blocks(lambda b: b * 2 - 1, x, split_axis=0, dtype=a.dtype)
    assert y.chunks == x.chunks
    assert not {"overlap-batch", "overlap-unbatch"} & set(task_prefixes(y))
    np.testing.assert_array_equal(y.compute(), a * 2 - 1)
    stats = wait_until_idle()
    assert (stats["partitions"], stats["sub_chunks"], stats["bytes_staged"]) == (12, 12, 0)


def test_the_same_blocks_are_joined_where_a_device_runs_them(small_batches, as_on_a_device):
    a = rows()
    x = da.from_array(a, chunks=(10, 8))
    with dask.config.set({"overlap.backend": "host"}):
        y = dask_overlap.map_blocks(lambda b: b * 2 - 1, x, split_axis=0, dtype=a.dtype)
        np.testing.assert_array_equal(y.compute(), a * 2 - 1)
    assert task_prefixes(y)["overlap-unbatch"] == 12
    assert wait_until_idle()["partitions"] == 3


def test_auto_sub_chunks_do_not_cut_on_the_host(host, small_batches):
    a = rows(64, 128)  # one partition of 64 KiB: a device would cut it in four
    x = da.from_array(a, chunks=(64, 128))
    y = dask_overlap.map_blocks(np.negative, x, split_axis=0, sub_chunk_bytes="auto")
    np.testing.assert_array_equal(y.compute(), -a)
    assert wait_until_idle()["sub_chunks"] == 1


def test_an_explicit_sub_chunk_size_still_cuts_on_the_host(host, small_batches):
    a = rows(64, 128)
    x = da.from_array(a, chunks=(64, 128))
    y = dask_overlap.map_blocks(np.negative, x, split_axis=0, sub_chunk_bytes=8192)
    np.testing.assert_array_equal(y.compute(), -a)
    assert wait_until_idle()["sub_chunks"] == 8  # 64 KiB in 8 KiB sub-chunks
    with dask.config.set({"overlap.sub-chunk-bytes": "16KiB"}):
        dask_overlap.close_runtimes()
        y = dask_overlap.map_blocks(np.negative, x, split_axis=0)
        np.testing.assert_array_equal(y.compute(), -a)
        assert wait_until_idle()["sub_chunks"] == 4


# -- across worker processes ---------------------------------------------------------------
@pytest.mark.timeout(120)
def test_workers_with_the_plugin_say_they_are_on_the_host(small_batches):
    """The heartbeat entry of LocalGPUCluster's workers (on the host backend, whatever
    this machine has) says where their partitions run."""
    with (
        LocalGPUCluster(
            allow_cpu=True, n_workers=2, threads_per_worker=1,
            options=Options.from_config(backend="host"),
        ) as cluster,
        Client(cluster) as client,
    ):  # fmt: skip
        assert dask.config.get("overlap.backend") == "auto"  # the client asks the workers
        poll(lambda: placement.placement("auto").on_host, 30, what="the workers on the host")
        a = rows()
        x = da.from_array(a, chunks=(10, 8))
        y = dask_overlap.map_blocks(lambda b: b + 1, x, split_axis=0, dtype=a.dtype)
        assert not {"overlap-batch", "overlap-unbatch"} & set(task_prefixes(y))
        np.testing.assert_array_equal(client.compute(y).result(), a + 1)
        stats = client.run(dask_overlap.runtime_stats).values()
        assert sum(s["partitions"] for s in stats) == 12


@pytest.mark.timeout(120)
def test_workers_without_the_plugin_are_asked(small_batches):
    """A plain LocalCluster's workers (no plugin, so no heartbeat entry) are asked where a
    partition would run: on the host backend, where they see no GPU."""
    with (
        LocalCluster(
            n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None,
            env={"CUDA_VISIBLE_DEVICES": ""},
        ) as cluster,
        Client(cluster) as client,
    ):  # fmt: skip
        workers = placement.distributed_workers()
        assert workers is not None and len(workers) == 2
        assert not any("overlap" in (w.get("metrics") or {}) for w in workers.values())
        assert placement.placement("auto").backends == {"host"}
        a = rows()
        y = dask_overlap.map_blocks(np.negative, da.from_array(a, chunks=(10, 8)), split_axis=0)
        assert "overlap-unbatch" not in task_prefixes(y)
        np.testing.assert_array_equal(client.compute(y).result(), -a)
