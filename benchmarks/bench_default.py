"""The path users run: no ``overlap.*`` settings, pageable input, a result larger than the pool.

In one process and one run, after a warm-up, on the same data (float32, made by the
benchmark in ordinary memory), each timed until every output chunk exists (``persist``
on Dask's default threaded scheduler):

1. naive Dask + CuPy: ``cp.asnumpy(f(cp.asarray(block)))`` per partition;
2. ``dask_overlap.map_blocks(f, x, split_axis=0)`` and ``dask_overlap.map_blocks(f, x)``,
   with no options at all (the default pinned pool, 4 GiB, is smaller than the result),
   in turn, ``--repeat`` pairs: the best of each, and split over no split best over best
   and as the median of the pairs' ratios;
3. a hand-written pipeline of the same shape with no Dask (``common.handwritten_runs``;
   CUDA only), its best over a few chunks-in-flight and thread counts;
4. the stage rates: PCIe each way and both ways, staging into pinned memory, unstaging
   into fresh arrays, the kernel;
5. a real library kernel: ``gaussian_filter1d`` along rows (cupyx on the GPU, SciPy on
   the CPU), naive and dask_overlap with defaults.

Every result is compared element by element with the naive path's. Writes the figures
the issue asks for (``--json PATH``; ``--record`` writes ``benchmarks/results/default-path.json``
and a line of ``benchmarks/results/history.jsonl``).

Example (CPU, small)::

    python benchmarks/bench_default.py --size 256MiB --partition 32MiB --no-gaussian
"""

from __future__ import annotations

import functools
import os
import sys
import time
from typing import Any

import dask
import dask.array as da
import numpy as np
from dask.utils import format_bytes

import dask_overlap

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (  # noqa: E402
    COLS,
    GB,
    add_output,
    add_repeat,
    array_of_views,
    best_persist,
    byte_count,
    comma_list,
    default_input,
    device_name,
    engine_busy,
    gaussian_case,
    handwritten_runs,
    naive,
    pair_ratios,
    parallel_copy_rate,
    parser,
    persist_chunks,
    persist_in_turn,
    rss,
    same_chunks,
    save,
    warm_up,
)

BENCHMARK = "default-path"


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
    p = parser(__doc__)
    p.add_argument("--size", type=byte_count, default="8GiB", help="input bytes (float32)")
    p.add_argument(
        "--partition", type=byte_count, default="256MiB", help="bytes per Dask partition"
    )
    add_repeat(p, 2)
    p.add_argument("--hand-in-flight", default="4,8", help="hand-written: chunks in flight")
    p.add_argument("--hand-threads", default="8,16", help="hand-written: copy threads")
    p.add_argument(
        "--gaussian-size", type=byte_count, default="4GiB", help="input of the gaussian case"
    )
    p.add_argument("--no-gaussian", action="store_true", help="skip the gaussian case")
    p.add_argument(
        "--sweep",
        action="store_true",
        help="also time split and whole partitions over sub-chunk sizes, copy piece sizes "
        "and Dask threads (to choose the defaults)",
    )
    add_output(p)
    args = p.parse_args(argv)

    rt = dask_overlap.get_runtime()  # the defaults: no overlap.* setting is touched
    backend = rt.name
    data = default_input(rt, args.size, args.partition)
    host, rows_per_part, x, func = data.host, data.rows_per_part, data.x, data.func
    nbytes = host.nbytes
    rates = stage_rates(host[:rows_per_part], rt.copy_threads)

    reference = naive(x, func)
    split = dask_overlap.map_blocks(func, x, split_axis=0, dtype=np.float32)
    whole = dask_overlap.map_blocks(func, x, dtype=np.float32)
    warm_up(reference, split, whole)  # compilation, pools, first touch

    naive_s, ref = best_persist(reference, 1)
    before, rss0 = rt.stats(), rss()
    _, got = persist_chunks(split)  # the memory its result takes (a run not timed)
    rss_split = rss() - rss0
    correct = same_chunks(ref, got)
    del got
    # Split and whole in turn, run for run: a drift of the machine's speed weighs on both
    # alike, and each pair gives a ratio.
    seconds, ok = persist_in_turn(
        {"split": split, "whole": whole}, args.repeat, functools.partial(same_chunks, ref)
    )
    correct = correct and all(ok.values())
    split_s, whole_s = min(seconds["split"]), min(seconds["whole"])
    vs = pair_ratios(seconds["split"], seconds["whole"])
    after = rt.stats()
    print(
        f"backend={backend} {format_bytes(nbytes)} in {x.numblocks[0]} partitions of "
        f"{format_bytes(rows_per_part * COLS * 4)}; copy threads {rt.copy_threads}"
    )
    print(f"  naive Dask                {nbytes / naive_s / GB:7.2f} GB/s")
    print(f"  default, split_axis=0     {nbytes / split_s / GB:7.2f} GB/s")
    print(f"  default, no split         {nbytes / whole_s / GB:7.2f} GB/s")

    hand: list[dict] = []
    if backend == "cuda":
        in_flights, threads = (comma_list(a, int) for a in (args.hand_in_flight, args.hand_threads))
        hand = handwritten_runs(host, func, ref, in_flights, threads, args.repeat)
    del ref

    default_s = min(split_s, whole_s)
    result: dict[str, Any] = {
        "device": device_name(backend),
        "backend": backend,
        "size_bytes": nbytes,
        "partition_bytes": rows_per_part * COLS * 4,
        "pinned_pool_size": rt.options.pinned_pool_size,
        "copy_threads": rt.copy_threads,
        "kernel_iterations": data.iterations,
        "kernel_seconds_per_partition": data.kernel_seconds,
        "rates_gbps": {
            k: v / GB
            for k, v in {**data.ceilings, **rates}.items()
            if isinstance(v, float) and k != "host_cores"
        },
        "naive_gbps": nbytes / naive_s / GB,
        "split_gbps": nbytes / split_s / GB,
        "nosplit_gbps": nbytes / whole_s / GB,
        "default_gbps": nbytes / split_s / GB,
        "speedup_vs_naive": naive_s / split_s,
        "split_over_nosplit": vs["best"],
        "split_over_nosplit_pairs": vs["pairs"],
        "split_over_nosplit_median": vs["median"],
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
        f"{result['split_over_nosplit']:.2f} (best over best; each pair's median "
        f"{result['split_over_nosplit_median']:.2f}); fallbacks {result['pinned_fallbacks']}; "
        f"pinned peak {format_bytes(result['pinned_peak_bytes'])} of "
        f"{format_bytes(rt.options.pinned_pool_size)}; result RSS "
        f"{result['result_rss_over_result_bytes']:.2f}x its bytes; correct={correct}"
    )
    print("  rates GB/s: " + " ".join(f"{k}={v:.1f}" for k, v in result["rates_gbps"].items()))
    if args.sweep:
        result["sweep"] = sweep(rt, x, func, nbytes, ref_sum(host, func, rows_per_part))
    if not args.no_gaussian:
        result["gaussian"] = gaussian_case(args.gaussian_size, rows_per_part)
    save(args, BENCHMARK, result, figures(result), result["device"])
    return result


def figures(result: dict[str, Any]) -> dict[str, Any]:
    """The headline numbers of a run (its history line)."""
    keys = ("size_bytes", "naive_gbps", "split_gbps", "nosplit_gbps", "handwritten_gbps")
    keys += ("speedup_vs_naive", "default_over_handwritten", "pinned_fallbacks", "correct")
    out = {k: result[k] for k in keys if k in result}
    if "gaussian" in result:
        g = result["gaussian"]
        out["gaussian"] = {k: g[k] for k in ("naive_gbps", "default_gbps", "correct")}
    return out


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


if __name__ == "__main__":
    main()
