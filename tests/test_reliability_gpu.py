"""Reliability (issue 6) on the GPU: the cuda backend's share of ``test_reliability.py``.

``pytest -m gpu tests/test_reliability_gpu.py`` on the device; skipped where CuPy, RMM or a
visible GPU is missing. Results are compared bit for bit with NumPy, so the functions here
are integer arithmetic or single correctly rounded float operations (no transcendental
functions, whose GPU and CPU versions may differ in the last bit).
"""

from __future__ import annotations

import _thread
import gc
import os
import re
import threading
import time
from collections.abc import Iterator
from typing import Any

import dask
import dask.array as da
import numpy as np
import pytest
from support import GPU_CONFIG, GPU_POOL, kill_a_busy_worker, poll, require_gpu

import dask_overlap

cp = require_gpu()

from conftest import wait_until_idle  # noqa: E402
from distributed import Client, LocalCluster  # noqa: E402

from dask_overlap import OverlapPlugin, runtime_stats  # noqa: E402

pytestmark = pytest.mark.gpu

POOL = GPU_POOL
CLUSTER_KW: dict[str, Any] = dict(dashboard_address=None, worker_dashboard_address=None)
# Small arrays through the ring all the same (direct_bytes=0).
PLUGIN = dict(
    backend="cuda", pinned_pool_size=POOL, device_pool_size="4GiB", in_flight=3, direct_bytes=0
)


@pytest.fixture(autouse=True)
def cuda_config() -> Iterator[None]:
    with dask.config.set(GPU_CONFIG):
        yield


def same_bits(got: np.ndarray, expected: np.ndarray) -> None:
    assert got.dtype == expected.dtype, (got.dtype, expected.dtype)
    assert got.shape == expected.shape, (got.shape, expected.shape)
    assert np.ascontiguousarray(got).tobytes() == np.ascontiguousarray(expected).tobytes()


def backend() -> Any:
    return dask_overlap.get_runtime("cuda").backend


def settled(device_before: int, timeout: float = 20.0) -> dict[str, Any]:
    """Once idle: nothing in flight, no pinned block held, device use back to where it was."""
    stats = wait_until_idle()
    assert stats["backend"] == "cuda" and stats["in_flight"] == 0

    def back() -> bool:
        gc.collect()
        s = dask_overlap.runtime_stats()
        return s["pinned_bytes_in_use"] == 0 and backend().device_bytes_in_use() <= device_before

    poll(back, timeout=timeout)
    return dask_overlap.runtime_stats()


def warm() -> int:
    """Build the runtime and CuPy's kernels; the device bytes in use afterwards."""
    x = da.from_array(np.arange(4096, dtype=np.int32).reshape(64, 64), chunks=(16, 64))
    dask_overlap.map_blocks(lambda b: b * 3 + 1, x, split_axis=0).compute()
    wait_until_idle()
    gc.collect()
    return backend().device_bytes_in_use()


def rows_data(rows: int, cols: int = 256) -> np.ndarray:
    return np.repeat(np.arange(rows, dtype=np.float32)[:, None], cols, axis=1)


class Boom(Exception):
    pass


# -- 1. func raises in one sub-chunk ----------------------------------------------------
@pytest.mark.timeout(120)
@pytest.mark.parametrize("row", [1024, 1536, 2047], ids=["first", "middle", "last"])
@pytest.mark.parametrize("split_axis", [0, None])
def test_func_raises(row: int, split_axis: int | None) -> None:
    device_before = warm()
    data = rows_data(3072)  # three partitions of 1 MiB, 64 sub-chunks of 16 kB each
    x = da.from_array(data, chunks=(1024, 256))

    def func(b: Any) -> Any:
        if b.size and bool((b[:, 0] == row).any()):
            raise Boom(f"row {row} is cursed")
        return b * 2

    kwargs = dict(split_axis=split_axis, sub_chunk_bytes=16 * 1024, dtype=x.dtype)
    with pytest.raises(Boom) as info:
        dask_overlap.map_blocks(func, x, **kwargs).compute()
    assert type(info.value) is Boom and str(info.value) == f"row {row} is cursed"
    del info
    stats = settled(device_before)
    assert stats["partitions_failed"] == 1
    same_bits(dask_overlap.map_blocks(lambda b: b * 2, x, **kwargs).compute(), data * 2)
    settled(device_before)


# -- 2. KeyboardInterrupt in the threaded scheduler -------------------------------------
FIRED = threading.Event()  # Ctrl-C once per test, from the first sub-chunk that matches


def interrupting(b: Any) -> Any:
    if b.size and bool((b[:, 0] == 1500).any()) and not FIRED.is_set():
        FIRED.set()
        _thread.interrupt_main()  # Ctrl-C in the caller, while this partition runs
    return b + 1


@pytest.mark.timeout(120)
def test_keyboard_interrupt() -> None:
    device_before = warm()
    FIRED.clear()
    data = rows_data(3072)
    x = da.from_array(data, chunks=(1024, 256))
    y = dask_overlap.map_blocks(interrupting, x, split_axis=0, sub_chunk_bytes=16 * 1024)
    with dask.config.set(num_workers=3), pytest.raises(KeyboardInterrupt):
        y.compute()
    settled(device_before)
    same_bits(dask_overlap.map_blocks(lambda b: b + 1, x).compute(), data + 1)


# -- 4. pinned pool smaller than a sub-chunk, and than a partition -----------------------
@pytest.mark.timeout(120)
@pytest.mark.parametrize("pool", [0, 8 * 1024, 512 * 1024], ids=["none", "sub", "partition"])
def test_small_pinned_pool(pool: int) -> None:
    data = np.arange(4096 * 256, dtype=np.int32).reshape(4096, 256)  # 1 MiB partitions
    x = da.from_array(data, chunks=(1024, 256))
    with dask.config.set({"overlap.pinned-pool-size": pool, "num_workers": 4}):
        dask_overlap.close_runtimes()
        y = dask_overlap.map_blocks(lambda b: b * 3 + 1, x, split_axis=0, sub_chunk_bytes=65536)
        z = dask_overlap.map_blocks(lambda b: b ^ 5, y, split_axis=0, sub_chunk_bytes=32768)
        same_bits(z.compute(), (data * 3 + 1) ^ 5)
    stats = wait_until_idle()
    assert stats["pinned_pool_size"] == pool
    assert stats["pinned_bytes_peak"] <= pool
    if pool < 2 * 65536:  # not one sub-chunk's way in and out fits: all of it falls back
        assert stats["pinned_fallbacks"] >= 2 * x.npartitions
    else:  # smaller than a partition: sub-chunks wait for ring room instead
        assert stats["pinned_fallbacks"] == 0
    assert stats["in_flight"] == 0


# -- 5. device memory exhausted by func -------------------------------------------------
ASK = 2**46  # 64 TiB: more than any device pool


def greedy(b: Any) -> Any:
    if b.size and bool((b[:, 0] == 1100).any()):
        cp.empty(ASK, dtype=cp.uint8)
    return b + 1


@pytest.mark.timeout(120)
@pytest.mark.parametrize("split_axis", [0, None])
def test_device_out_of_memory(split_axis: int | None) -> None:
    device_before = warm()
    data = rows_data(3072)
    x = da.from_array(data, chunks=(1024, 256))
    y = dask_overlap.map_blocks(greedy, x, split_axis=split_axis, sub_chunk_bytes=65536)
    with pytest.raises(MemoryError) as info:
        y.compute()
    msg = str(info.value)
    assert f"partition ('{y.name}', 1, 0)" in msg, msg
    assert "greedy" in msg and f"{ASK:,} bytes" in msg and "device" in msg, msg
    assert isinstance(info.value.__cause__, MemoryError)
    del info
    stats = settled(device_before)
    assert stats["partitions_failed"] == 1
    # the device is still usable
    same_bits(dask_overlap.map_blocks(lambda b: b + 1, x).compute(), data + 1)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_device_out_of_memory_on_a_worker_leaves_it_usable() -> None:
    data = rows_data(3072)
    x = da.from_array(data, chunks=(1024, 256))
    with (
        LocalCluster(n_workers=1, threads_per_worker=2, processes=True, **CLUSTER_KW) as cluster,
        Client(cluster) as client,
    ):
        client.register_plugin(OverlapPlugin(**PLUGIN))
        y = dask_overlap.map_blocks(greedy, x, split_axis=0, sub_chunk_bytes=65536)
        with pytest.raises(MemoryError, match=re.escape(f"{ASK:,} bytes")) as info:
            client.compute(y, sync=True)
        assert f"partition ('{y.name}', 1, 0)" in str(info.value)
        del info
        z = dask_overlap.map_blocks(lambda b: b + 1, x, split_axis=0)
        same_bits(client.compute(z, sync=True), data + 1)
        (stats,) = poll(
            lambda: (
                (s := client.run(runtime_stats))
                and all(v["partitions_active"] == 0 and v["in_flight"] == 0 for v in s.values())
                and list(s.values())
            )
        )
        assert stats["backend"] == "cuda" and stats["partitions_failed"] == 1


# -- 6. output dtype or shape other than declared ---------------------------------------
@pytest.mark.parametrize("split_axis", [None, 0])
def test_output_other_than_declared(split_axis: int | None) -> None:
    x = da.from_array(rows_data(2048), chunks=(1024, 256))
    y = dask_overlap.map_blocks(
        lambda b: b.astype(cp.float64), x, dtype=np.float32, split_axis=split_axis
    )
    with pytest.raises(ValueError, match=re.escape(f"partition ('{y.name}', ")) as info:
        y.compute()
    assert "float64" in str(info.value) and "declares dtype float32" in str(info.value)
    del info
    y = dask_overlap.map_blocks(lambda b: b[:, :3], x, split_axis=split_axis)
    with pytest.raises(ValueError, match=re.escape("(1024, 256)")):
        y.compute()


# -- 7. odd inputs ----------------------------------------------------------------------
def times_three(b: Any) -> Any:
    return b * 3


CASES = {
    "empty": (np.ones((0, 64), np.float32), (16, 16)),
    "empty-chunks": (np.arange(600, dtype=np.int32).reshape(20, 30), ((8, 0, 12), (0, 30))),
    "fortran": (np.asfortranarray(np.arange(64 * 48, dtype=np.int64).reshape(64, 48)), (16, 24)),
    "big-endian": ((np.arange(40 * 30) - 300).astype(">i4").reshape(40, 30), (16, 10)),
    "big-endian-float": (np.arange(40 * 30, dtype=">f8").reshape(40, 30), (16, 10)),
    "uneven": (np.arange(3000 * 4, dtype=np.int32).reshape(3000, 4), ((1, 2990, 3, 6), (4,))),
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("split_axis", [None, 0, 1])
def test_odd_inputs_match_numpy(case: str, split_axis: int | None) -> None:
    a, chunks = CASES[case]
    x = da.from_array(a, chunks=chunks)
    y = dask_overlap.map_blocks(times_three, x, split_axis=split_axis, sub_chunk_bytes=64)
    expected = a * 3
    got = y.compute()
    assert y.dtype == got.dtype
    same_bits(got, expected)


def test_zero_d_inputs() -> None:
    x = da.from_array(np.float32(2.5))
    same_bits(dask_overlap.map_blocks(times_three, x).compute(), np.float32(2.5) * 3)
    z = da.from_array(np.arange(12, dtype=np.float32).reshape(3, 4), chunks=(2, 2))
    y = dask_overlap.map_blocks(lambda u, v: u * v, z, x, split_axis=0, sub_chunk_bytes=8)
    same_bits(y.compute(), np.arange(12, dtype=np.float32).reshape(3, 4) * np.float32(2.5))


def test_big_endian_kept_is_a_clear_error() -> None:
    """CuPy computes in native byte order: a func that keeps its input's dtype returns
    native values where Dask declared big-endian, which is said, not handed on."""
    a = np.arange(40, dtype=">f8").reshape(8, 5)
    y = dask_overlap.map_blocks(lambda b: b.copy(), da.from_array(a, chunks=(4, 5)))
    assert y.dtype == np.dtype(">f8")
    with pytest.raises(ValueError, match=re.escape("declares dtype >f8")):
        y.compute()


@pytest.mark.timeout(120)
def test_one_chunk_larger_than_the_pinned_pool() -> None:
    a = np.arange(8192 * 256, dtype=np.int32).reshape(8192, 256)  # one 8 MiB chunk
    x = da.from_array(a, chunks=-1)
    with dask.config.set({"overlap.pinned-pool-size": "1MiB"}):
        dask_overlap.close_runtimes()
        for split_axis in (None, 0):
            y = dask_overlap.map_blocks(
                times_three, x, split_axis=split_axis, sub_chunk_bytes="256KiB"
            )
            same_bits(y.compute(), a * 3)
    stats = wait_until_idle()
    assert stats["pinned_fallbacks"] > 0 and stats["pinned_bytes_peak"] <= 2**20


# -- 8. stress --------------------------------------------------------------------------
def stress_data(seed: int) -> tuple[da.Array, np.ndarray, int, int]:
    """1,000 partitions of random sizes, made where they are used (a graph carrying the data
    would be tens of MiB), and the same data here, for the reference."""
    rng = np.random.default_rng(seed)
    sizes = tuple(int(n) for n in rng.integers(1, 96, size=1000))
    sub1, sub2 = (int(n) for n in rng.integers(1024, 64 * 1024, size=2))
    x = da.random.default_rng(seed).integers(
        -(2**20), 2**20, size=(sum(sizes), 256), chunks=(sizes, 256), dtype=np.int32
    )
    return x, x.compute(scheduler="threads"), sub1, sub2


def stress_graph(x: da.Array, sub1: int, sub2: int) -> da.Array:
    y = dask_overlap.map_blocks(lambda b: b * 3 + 1, x, split_axis=0, sub_chunk_bytes=sub1)
    return dask_overlap.map_blocks(
        lambda b: (b ^ 0x5A5A) - 7, y, split_axis=0, sub_chunk_bytes=sub2
    )


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_stress_a_thousand_partitions_threaded() -> None:
    device_before = warm()
    x, data, sub1, sub2 = stress_data(8)
    assert x.npartitions == 1000
    with dask.config.set(num_workers=6):
        same_bits(stress_graph(x, sub1, sub2).compute(), ((data * 3 + 1) ^ 0x5A5A) - 7)
    stats = settled(device_before, timeout=60)
    assert stats["partitions"] == 2000 + 4  # and the warm-up's
    assert stats["partitions_failed"] == 0
    assert stats["pinned_bytes_peak"] <= POOL


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_stress_a_thousand_partitions_on_two_workers() -> None:
    x, data, sub1, sub2 = stress_data(9)
    with (
        LocalCluster(n_workers=2, threads_per_worker=3, processes=True, **CLUSTER_KW) as cluster,
        Client(cluster) as client,
    ):
        client.register_plugin(OverlapPlugin(**PLUGIN))
        got = client.compute(stress_graph(x, sub1, sub2), sync=True)
        same_bits(got, ((data * 3 + 1) ^ 0x5A5A) - 7)

        def check() -> dict | None:
            client.run(gc.collect)
            s = client.run(runtime_stats)
            held = ("partitions_active", "in_flight", "pinned_bytes_in_use")
            return s if all(v[k] == 0 for v in s.values() for k in held) else None

        stats = poll(check, timeout=60)
        assert sum(v["partitions"] for v in stats.values()) == 2000
        assert all(v["partitions"] > 0 for v in stats.values()), "both workers took part"
        assert all(v["pinned_bytes_peak"] <= v["pinned_pool_size"] for v in stats.values())


# -- 9. two clients at once -------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_two_clients_at_once(tmp_path) -> None:
    marker = str(tmp_path / "b-is-running")
    a_data = np.arange(2048 * 256, dtype=np.int32).reshape(2048, 256)
    b_data = a_data[::-1].copy()
    last = 2047 // 64

    def a_func(blk: Any, block_id: tuple | None = None) -> Any:
        if blk.size and block_id is not None and block_id[0] == last:
            deadline = time.monotonic() + 60
            while not os.path.exists(marker):
                if time.monotonic() > deadline:
                    raise TimeoutError("client B never ran while A was running")
                time.sleep(0.01)
        return blk * 3 + 1

    def b_func(blk: Any) -> Any:
        if blk.size:
            open(marker, "a").close()
        return blk ^ 5

    with (
        LocalCluster(n_workers=2, threads_per_worker=3, processes=True, **CLUSTER_KW) as cluster,
        Client(cluster, set_as_default=False) as ca,
        Client(cluster, set_as_default=False) as cb,
    ):
        ca.register_plugin(OverlapPlugin(**{**PLUGIN, "pinned_pool_size": "256KiB"}))
        a = dask_overlap.map_blocks(
            a_func, da.from_array(a_data, chunks=(64, 256)), split_axis=0, sub_chunk_bytes=8192
        )
        b = dask_overlap.map_blocks(
            b_func, da.from_array(b_data, chunks=(64, 256)), split_axis=0, sub_chunk_bytes=16384
        )
        fa, fb = ca.compute(a), cb.compute(b)
        same_bits(fa.result(timeout=120), a_data * 3 + 1)
        same_bits(fb.result(timeout=120), b_data ^ 5)
        del fa, fb
        stats = poll(
            lambda: (
                (s := ca.run(runtime_stats))
                and all(v["partitions_active"] == 0 for v in s.values())
                and s
            )
        )
        assert sum(v["partitions"] for v in stats.values()) == 64
        assert all(v["pinned_bytes_peak"] <= v["pinned_pool_size"] for v in stats.values())
        assert sum(v["ring_full"] for v in stats.values()) > 0  # the bound binds, and holds:
        # sub-chunks wait for room instead of falling back. In a pool this small, RMM's
        # free list can fragment, so a block can fail to come even when the budget has
        # room (seen once on the H200: 1 of 512 buffers); that one goes through pageable
        # memory, counted, and must stay rare.
        subs = sum(v["sub_chunks"] for v in stats.values())
        assert sum(v["pinned_fallbacks"] for v in stats.values()) <= subs // 50


# -- 3. a worker killed mid-computation -------------------------------------------------
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_worker_killed_mid_computation(tmp_path) -> None:
    marker = str(tmp_path / "killed")
    data = np.arange(2048 * 256, dtype=np.int32).reshape(2048, 256)

    def held_back(blk: Any, block_id: tuple | None = None) -> Any:
        if blk.size and block_id is not None and block_id[0] >= 16:
            deadline = time.monotonic() + 60
            while not os.path.exists(marker) and time.monotonic() < deadline:
                time.sleep(0.01)
        return blk * 3 + 1

    with (
        LocalCluster(n_workers=2, threads_per_worker=2, processes=True, **CLUSTER_KW) as cluster,
        Client(cluster) as client,
    ):
        client.register_plugin(OverlapPlugin(**PLUGIN))
        x = da.from_array(data, chunks=(64, 256))
        fut = client.compute(dask_overlap.map_blocks(held_back, x, split_axis=0))
        kill_a_busy_worker(client, fut)
        open(marker, "a").close()
        same_bits(fut.result(timeout=180), data * 3 + 1)
