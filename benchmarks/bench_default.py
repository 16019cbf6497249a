"""The path users run: no ``overlap.*`` settings, pageable input, a result larger than the pool.

In one process and one run, after a warm-up, on the same data (float32, made by the
benchmark in ordinary memory), each timed until every output chunk exists (``persist``
on Dask's default threaded scheduler):

1. naive Dask + CuPy: ``cp.asnumpy(f(cp.asarray(block)))`` per partition;
2. ``dask_overlap.map_blocks(f, x, split_axis=0)`` and ``dask_overlap.map_blocks(f, x)``,
   with no options at all (the default pinned pool, 4 GiB, is smaller than the result);
3. a hand-written pipeline of the same shape with no Dask (``handwritten.py``; CUDA
   only), its best over a few chunks-in-flight and thread counts;
4. the stage rates: PCIe each way and both ways, staging into pinned memory, unstaging
   into fresh arrays, the kernel;
5. a real library kernel: ``gaussian_filter1d`` along rows (cupyx on the GPU, SciPy on
   the CPU), naive and dask_overlap with defaults.

Every result is compared element by element with the naive path's. Writes the figures
the issue asks for (``--json``, e.g. ``benchmarks/results/default-path.json``).

Example (CPU, small)::

    python benchmarks/bench_default.py --size 256MiB --partition 32MiB --no-gaussian
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import dask
import dask.array as da
import numpy as np
from dask.utils import format_bytes, parse_bytes

import dask_overlap

sys.path.insert(0, os.path.dirname(__file__))
from bench_overlap import (  # noqa: E402
    KERNEL_RATIO,
    array_of_views,
    comma_list,
    same_chunks,
    write_json,
)
from ceilings import measure_ceilings, parallel_copy_rate  # noqa: E402
from kernels import make_kernel  # noqa: E402

GB = 1e9


def random_data(shape: tuple[int, int], threads: int = 16) -> np.ndarray:
    """Float32 random data in ordinary memory, made by several threads (NumPy's
    generators release the GIL)."""
    out = np.empty(shape, np.float32)
    bounds = np.linspace(0, shape[0], threads + 1).astype(int)

    def fill(k: int) -> None:
        rng = np.random.default_rng(k)
        rng.random(out=out[bounds[k] : bounds[k + 1]], dtype=np.float32)

    with ThreadPoolExecutor(threads) as ex:
        list(ex.map(fill, range(threads)))
    return out


def rss() -> int:
    """This process's resident bytes (Linux)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def gaussian(block: Any) -> Any:
    """``gaussian_filter1d`` along rows, on CuPy or NumPy blocks alike."""
    if isinstance(block, np.ndarray):
        from scipy.ndimage import gaussian_filter1d
    else:
        from cupyx.scipy.ndimage import gaussian_filter1d
    return gaussian_filter1d(block, sigma=8.0, axis=-1)


def best_persist(arr: da.Array, repeat: int) -> tuple[float, list[np.ndarray]]:
    """Best of ``repeat`` persists on the default threaded scheduler, and its chunks."""
    best, chunks = float("inf"), []
    for _ in range(repeat):
        chunks = []
        t0 = time.perf_counter()
        (done,) = dask.persist(arr)
        seconds = time.perf_counter() - t0
        if seconds < best:
            best = seconds
        graph = done.__dask_graph__()
        chunks = [graph[k] for k in dask.core.flatten(done.__dask_keys__())]
        del done, graph
    return best, chunks


def stage_rates(block: np.ndarray, threads: int) -> dict[str, float]:
    """Host copy rates with ``threads`` threads: into pinned (staging) and out of pinned
    into fresh arrays (unstaging, first touch included)."""
    rt = dask_overlap.get_runtime()
    pool = rt.backend.pinned
    pinned = pool.allocate(block.nbytes)
    if pinned is None:
        return {}
    pinned = pinned.view(block.dtype).reshape(block.shape)
    return {
        "staging": parallel_copy_rate(block, pinned, threads),
        "unstaging": parallel_copy_rate(pinned, None, threads),
    }


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="8GiB", help="input bytes (float32)")
    p.add_argument("--partition", default="256MiB", help="bytes per Dask partition")
    p.add_argument("--repeat", type=int, default=2, help="timed runs of each path; best kept")
    p.add_argument("--hand-in-flight", default="4,8", help="hand-written: chunks in flight")
    p.add_argument("--hand-threads", default="8,16", help="hand-written: copy threads")
    p.add_argument("--gaussian-size", default="4GiB", help="input of the gaussian case")
    p.add_argument("--no-gaussian", action="store_true", help="skip the gaussian case")
    p.add_argument(
        "--sweep",
        action="store_true",
        help="also time split and whole partitions over sub-chunk sizes, copy piece sizes "
        "and Dask threads (to choose the defaults)",
    )
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args(argv)

    rt = dask_overlap.get_runtime()  # the defaults: no overlap.* setting is touched
    backend = rt.name
    size, part = parse_bytes(args.size), parse_bytes(args.partition)
    cols = 1024
    rows, rows_per_part = max(1, size // (4 * cols)), max(1, part // (4 * cols))
    host = random_data((rows, cols))
    nbytes = host.nbytes
    ceilings, kernel_s_part, iterations = measure_ceilings(
        rt, host[:rows_per_part], "balanced", KERNEL_RATIO["balanced"], make_kernel
    )
    func = make_kernel(iterations)
    rates = stage_rates(host[:rows_per_part], rt.copy_threads)
    x = array_of_views(host, rows_per_part)

    def naive_block(b: np.ndarray) -> np.ndarray:
        return rt.backend.naive(func, b)

    naive = da.map_blocks(naive_block, x, dtype=np.float32)
    split = dask_overlap.map_blocks(func, x, split_axis=0, dtype=np.float32)
    whole = dask_overlap.map_blocks(func, x, dtype=np.float32)
    for arr in (naive, split, whole):  # compilation, pools, first touch
        dask.persist(arr[: 2 * rows_per_part])

    naive_s, ref = best_persist(naive, 1)
    before, rss0 = rt.stats(), rss()
    split_s, got = best_persist(split, args.repeat)
    rss_split = rss() - rss0
    correct = same_chunks(ref, got)
    del got
    whole_s, got = best_persist(whole, args.repeat)
    correct = correct and same_chunks(ref, got)
    del got
    after = rt.stats()
    print(
        f"backend={backend} {format_bytes(nbytes)} in {x.numblocks[0]} partitions of "
        f"{format_bytes(rows_per_part * cols * 4)}; copy threads {rt.copy_threads}"
    )
    print(f"  naive Dask                {nbytes / naive_s / GB:7.2f} GB/s")
    print(f"  default, split_axis=0     {nbytes / split_s / GB:7.2f} GB/s")
    print(f"  default, no split         {nbytes / whole_s / GB:7.2f} GB/s")

    hand: list[dict] = []
    if backend == "cuda":
        from handwritten import run_handwritten

        for k in comma_list(args.hand_in_flight, int):
            for t in comma_list(args.hand_threads, int):
                rows_per_chunk = max(1, parse_bytes("64MiB") // (4 * cols))
                best = float("inf")
                for _ in range(args.repeat):
                    seconds, chunks = run_handwritten(host, rows_per_chunk, func, k, t)
                    best = min(best, seconds)
                ok = np.array_equal(np.concatenate(chunks), np.concatenate(ref))
                del chunks
                hand.append({"in_flight": k, "threads": t, "gbps": nbytes / best / GB, "ok": ok})
                print(
                    f"  hand-written, {k} in flight, {t} threads: {hand[-1]['gbps']:7.2f} GB/s"
                    + ("" if ok else "  WRONG")
                )
    del ref

    default_s = min(split_s, whole_s)
    result: dict[str, Any] = {
        "device": _device_name(backend),
        "backend": backend,
        "size_bytes": nbytes,
        "partition_bytes": rows_per_part * cols * 4,
        "pinned_pool_size": rt.options.pinned_pool_size,
        "copy_threads": rt.copy_threads,
        "kernel_iterations": iterations,
        "kernel_seconds_per_partition": kernel_s_part,
        "rates_gbps": {
            k: v / GB
            for k, v in {**ceilings, **rates}.items()
            if isinstance(v, float) and k != "host_cores"
        },
        "naive_gbps": nbytes / naive_s / GB,
        "split_gbps": nbytes / split_s / GB,
        "nosplit_gbps": nbytes / whole_s / GB,
        "default_gbps": nbytes / split_s / GB,
        "speedup_vs_naive": naive_s / split_s,
        "split_over_nosplit": whole_s / split_s,
        "best_default_gbps": nbytes / default_s / GB,
        "pinned_fallbacks": after["pinned_fallbacks"] - before["pinned_fallbacks"],
        "ring_full": after["ring_full"] - before["ring_full"],
        "pinned_peak_bytes": after["pinned_bytes_peak"],
        "result_rss_over_result_bytes": rss_split / nbytes,
        "correct": bool(correct),
        "handwritten": hand,
    }
    if hand:
        top = max(hand, key=lambda h: h["gbps"])
        result["handwritten_gbps"] = top["gbps"]
        result["default_over_handwritten"] = result["default_gbps"] / top["gbps"]
        print(f"  default/hand-written {result['default_over_handwritten']:.3f}")
    print(
        f"  speed-up vs naive {result['speedup_vs_naive']:.2f}x; split/no split "
        f"{result['split_over_nosplit']:.2f}; fallbacks {result['pinned_fallbacks']}; pinned "
        f"peak {format_bytes(result['pinned_peak_bytes'])} of "
        f"{format_bytes(rt.options.pinned_pool_size)}; result RSS "
        f"{result['result_rss_over_result_bytes']:.2f}x its bytes; correct={correct}"
    )
    print("  rates GB/s: " + " ".join(f"{k}={v:.1f}" for k, v in result["rates_gbps"].items()))
    if args.sweep:
        result["sweep"] = sweep(rt, x, func, nbytes, ref_sum(host, func, rows_per_part))
    if not args.no_gaussian:
        result["gaussian"] = gaussian_case(rt, parse_bytes(args.gaussian_size), rows_per_part)
    write_json(args.json, result)
    return result


def ref_sum(host: np.ndarray, func: Any, rows_per_part: int) -> float:
    """A cheap fingerprint of the right result (the sweep's check)."""
    return float(
        np.asarray(
            dask_overlap.map_blocks(
                func, array_of_views(host, rows_per_part), dtype=np.float32
            ).sum(dtype=np.float64)
        )
    )


def sweep(rt: Any, x: da.Array, func: Any, nbytes: int, want: float) -> list[dict]:
    """Split and whole partitions over sub-chunk sizes, copy piece sizes and threads, with
    each engine's busy fraction (from the runtime's timeline)."""
    from bench_overlap import engine_busy

    out = []
    default_piece = rt.copies.piece_bytes
    configs = [
        (split, sub, piece, threads)
        for piece in (default_piece,)
        for threads in (None, 4)
        for split, sub in ((0, None), (0, 64 << 20), (None, None))
    ]
    for split, sub, piece, threads in configs:
        rt.copies.piece_bytes = piece
        arr = dask_overlap.map_blocks(
            func, x, split_axis=split, sub_chunk_bytes=sub, dtype=np.float32
        )
        best, busy = float("inf"), {}
        for _ in range(2):
            rt.timeline.clear()
            start = time.time()
            t0, cpu0 = time.perf_counter(), time.process_time()
            (done,) = dask.persist(arr, num_workers=threads)
            seconds, cpu = time.perf_counter() - t0, time.process_time() - cpu0
            if seconds < best:
                best, best_cpu = seconds, cpu
                busy = engine_busy(list(rt.timeline), start, start + seconds)
            ok = abs(float(done.sum(dtype=np.float64).compute()) - want) <= 1e-6 * abs(want)
            del done
        row = {
            "split_axis": split,
            "sub_chunk_bytes": sub,
            "piece_bytes": piece,
            "threads": threads or os.cpu_count(),
            "gbps": nbytes / best / GB,
            "cpu_seconds": best_cpu,
            "ok": ok,
            "busy": busy,
        }
        out.append(row)
        print(
            f"  sweep split={split} sub={format_bytes(sub) if sub else 'default'} "
            f"piece={format_bytes(piece)} "
            f"threads={row['threads']}: {row['gbps']:.2f} GB/s cpu {best_cpu:.2f} s busy "
            + " ".join(f"{k}={v:.2f}" for k, v in busy.items())
            + ("" if ok else " WRONG")
        )
    rt.copies.piece_bytes = default_piece
    return out


def gaussian_case(rt: Any, size: int, rows_per_part: int) -> dict[str, Any]:
    """``gaussian_filter1d`` along rows: naive against dask_overlap with defaults."""
    cols = 1024
    host = random_data((max(1, size // (4 * cols)), cols))
    x = array_of_views(host, rows_per_part)

    def naive_block(b: np.ndarray) -> np.ndarray:
        return rt.backend.naive(gaussian, b)

    naive = x.map_blocks(naive_block, dtype=np.float32)
    ours = dask_overlap.map_blocks(gaussian, x, split_axis=0, dtype=np.float32)
    whole = dask_overlap.map_blocks(gaussian, x, dtype=np.float32)
    dask.persist(naive[:rows_per_part], ours[:rows_per_part], whole[:rows_per_part])
    naive_s, ref = best_persist(naive, 1)
    ours_s, got = best_persist(ours, 2)
    correct = same_chunks(ref, got)
    del got
    whole_s, got = best_persist(whole, 2)
    correct = correct and same_chunks(ref, got)
    out = {
        "size_bytes": host.nbytes,
        "naive_gbps": host.nbytes / naive_s / GB,
        "default_gbps": host.nbytes / ours_s / GB,
        "nosplit_gbps": host.nbytes / whole_s / GB,
        "speedup_vs_naive": naive_s / ours_s,
        "correct": bool(correct),
    }
    print(
        f"  gaussian_filter1d along rows, {format_bytes(host.nbytes)}: naive "
        f"{out['naive_gbps']:.2f} GB/s, dask_overlap {out['default_gbps']:.2f} GB/s "
        f"(no split {out['nosplit_gbps']:.2f}), {out['speedup_vs_naive']:.2f}x, "
        f"correct={out['correct']}"
    )
    return out


def _device_name(backend: str) -> str:
    if backend != "cuda":
        import platform

        return f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"
    import cupy

    return cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)["name"].decode()


if __name__ == "__main__":
    main()
