"""Benchmark: naive Dask copy-in/compute/copy-out against dask_overlap, beside the bound.

In one process and one run, after a warm-up, on the same data:

1. the naive Dask path: ``da.map_blocks`` whose function copies a block in, computes and
   copies it out, one step at a time (``runtime.backend.naive``);
2. ``dask_overlap.map_blocks`` with ``split_axis=0``;
3. the bound: the slowest stage at the measured (or, for ``timed``, modelled) rates.

Each is timed until every output chunk exists (``persist``), not to one concatenated
array: computing to one NumPy array adds a single-threaded concatenation into fresh
memory (about 10 GB/s on the H200 host) that would hide the pipeline. The two results
are compared element by element.

``bench_overlap.py default [ARGS]`` runs the ``default`` case instead: the path users run,
with no options at all (``bench_default.py``, which takes the same ARGS).

Example::

    python benchmarks/bench_overlap.py --backend timed --workload balanced \\
        --size 512MiB --partition 64MiB --json bench-out/timed.json
    python benchmarks/bench_overlap.py default --size 1GiB --partition 64MiB
"""

from __future__ import annotations

import itertools
import os
import sys
import time
from typing import Any

import dask
import dask.array as da
import numpy as np
from dask.utils import format_bytes, parse_bytes

import dask_overlap
from dask_overlap.backends import resolve_backend

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (  # noqa: E402
    COLS,
    KERNEL_RATIO,
    WORKLOADS,
    add_backend,
    add_output,
    add_repeat,
    array_of_views,
    best_of,
    bound_seconds,
    byte_count,
    comma_list,
    device_name,
    engine_busy,
    make_kernel,
    measure_ceilings,
    naive,
    parser,
    persist_chunks,
    pinned_copy,
    pinned_pool_size,
    same_chunks,
    save,
    write_json,
)


def show_bytes(n: int | str) -> str:
    """A byte count for people (``auto`` and other words as they are)."""
    return n if isinstance(n, str) else format_bytes(n)


def timeline_of(spans: list, start: float, seconds: float, *config: Any) -> dict[str, Any]:
    """One run's stage spans (seconds from its start), for a picture or a diagnosis."""
    keys = {k: n for n, k in enumerate(dict.fromkeys(s.key for s in spans))}
    return {
        "seconds": seconds,
        "config": dict(zip(("sub_chunk_bytes", "in_flight", "threads"), config, strict=True)),
        "columns": ["partition", "sub_chunk", "stream", "stage", "start", "end", "bytes"],
        "spans": [
            [keys[s.key], s.sub_chunk, s.stream, s.stage, s.start - start, s.end - start, s.nbytes]
            for s in spans
        ],
    }


def persist_seconds(arr: da.Array, threads: int) -> tuple[float, list[np.ndarray]]:
    """Seconds until every chunk of ``arr`` exists, and the chunks (in block order).
    ``threads`` 0: the synchronous scheduler (one thread: a profiler sees every task)."""
    if threads:
        return persist_chunks(arr, scheduler="threads", num_workers=threads)
    return persist_chunks(arr, scheduler="sync")


def configure_timed(workload: str) -> None:
    """Model the workload's kernel on the timed backend (relative to its H2D rate)."""
    h2d = parse_bytes(str(dask.config.get("overlap.timed.h2d-bandwidth")))
    ratio = KERNEL_RATIO[workload]
    kernel_bw = h2d / ratio if ratio else h2d * 20
    dask.config.set({"overlap.timed.kernel-bandwidth": int(kernel_bw)})


def caveats(backend: str, over_bound: float) -> list[str]:
    """What a reader of the figures must know: the host backend is a correctness path,
    and the bound is a model, which a run can pass."""
    out = []
    if backend == "host":
        out.append(
            "the host backend is the correctness path: its 'device' stages are host work "
            "on the same cores, so these figures say nothing of a GPU"
        )
    if over_bound > 1:
        out.append(
            f"overlap/bound {over_bound:.2f} > 1: the bound is the slowest stage at rates "
            "measured on their own (one partition, or 64 MiB of host copies), not a limit "
            "the run cannot pass (small copies, caches, or stages the model counts apart)"
        )
    return out


def main(argv: list[str] | None = None) -> dict:
    p = parser(__doc__)
    add_backend(p)
    p.add_argument("--workload", default="balanced", choices=WORKLOADS)
    p.add_argument("--size", type=byte_count, default="256MiB", help="input bytes (float32)")
    p.add_argument("--partition", type=byte_count, default="32MiB", help="bytes per Dask partition")
    p.add_argument(
        "--sub-chunk", default="", help="bytes per sub-chunk, a comma list (default: config)"
    )
    p.add_argument("--in-flight", default="", help="sub-chunks in flight, a comma list")
    p.add_argument(
        "--threads", default="4", help="Dask threads (partitions at once), a comma list; 0: sync"
    )
    p.add_argument("--naive-threads", default="", help="comma list; default: first of --threads")
    p.add_argument("--pinned-input", action="store_true", help="input already in pinned memory")
    p.add_argument(
        "--out",
        default="host",
        choices=["host", "pinned"],
        help="where results live: ordinary arrays (the default) or the pinned pool",
    )
    add_repeat(p, 1)
    p.add_argument(
        "--batch",
        type=lambda s: s if s == "auto" else int(s),
        default="auto",
        help="blocks joined per partition (map_blocks batch=; default: its default, auto)",
    )
    add_output(p)
    p.add_argument(
        "--case", default=None, help="this run's name in the current file (WORKLOAD-INPUT)"
    )
    p.add_argument("--timeline-json", default=None, help="write the fastest run's stage spans here")
    args = p.parse_args(argv)

    backend = resolve_backend(args.backend)
    rows = max(1, args.size // (4 * COLS))
    rows_per_part = max(1, args.partition // (4 * COLS))
    nbytes = rows * COLS * 4
    subs = comma_list(args.sub_chunk, parse_bytes) or [None]
    in_flights = comma_list(args.in_flight, int) or [None]
    threads = comma_list(args.threads, int) or [4]
    cfg = {
        "overlap.backend": backend,
        "overlap.pinned-pool-size": pinned_pool_size(nbytes, args.out, args.pinned_input, backend),
    }
    dask.config.set(cfg)
    if backend == "timed":
        configure_timed(args.workload)
    dask_overlap.close_runtimes()
    rt = dask_overlap.get_runtime(backend)

    rng = np.random.default_rng(0)
    host = rng.random((rows, COLS), dtype=np.float32)
    if args.pinned_input:
        host = pinned_copy(rt, host)

    ceilings, kernel_s_part, iterations = measure_ceilings(rt, host[:rows_per_part], args.workload)
    func = make_kernel(iterations)
    x = array_of_views(host, rows_per_part)
    n_parts = x.numblocks[0]
    kernel_s = kernel_s_part * rows / rows_per_part
    naive_threads = comma_list(args.naive_threads, int) or threads[:1]

    def overlapped(data: da.Array, sub: int | None, in_flight: int | None) -> da.Array:
        return dask_overlap.map_blocks(
            func,
            data,
            split_axis=0,
            sub_chunk_bytes=sub,
            in_flight=in_flight,
            dtype=np.float32,
            out=args.out,
            batch=args.batch,
        )

    # Warm-up: compilation, pool creation and first touch stay out of the numbers.
    warm = x[: min(rows, 2 * rows_per_part)]
    dask.persist(naive(warm, func, backend), scheduler="threads")
    for sub in subs:
        dask.persist(overlapped(warm, sub, in_flights[0]), scheduler="threads")

    reference = naive(x, func, backend)
    naive_runs = {}
    naive_chunks = None
    for t in naive_threads:
        naive_runs[t], naive_chunks = best_of(
            lambda t=t: persist_seconds(reference, t), args.repeat
        )

    staged = not args.pinned_input
    out_bytes = nbytes  # the kernel is elementwise: one output byte per input byte
    bound_s, bound_stage, stages = bound_seconds(
        nbytes, out_bytes, kernel_s, ceilings, staged, unstaged=args.out == "host"
    )
    before = rt.stats()
    runs: list[dict] = []
    timeline: dict = {}
    for sub, in_flight, t in itertools.product(subs, in_flights, threads):
        arr = overlapped(x, sub, in_flight)
        best, busy, correct, cpu = float("inf"), {}, True, 0.0
        for _ in range(args.repeat):
            overlap_chunks = None
            rt.timeline.clear()
            start, cpu0 = time.time(), time.process_time()
            seconds, overlap_chunks = persist_seconds(arr, t)
            if seconds < best:
                cpu = time.process_time() - cpu0  # every thread of this process
                spans = list(rt.timeline)
                best, busy = seconds, engine_busy(spans, start, start + seconds)
                if args.timeline_json and (not timeline or best < timeline["seconds"]):
                    timeline = timeline_of(
                        spans,
                        start,
                        best,
                        sub or rt.options.sub_chunk_bytes,
                        in_flight or rt.options.in_flight,
                        t,
                    )
            correct = correct and same_chunks(naive_chunks, overlap_chunks)
        runs.append(
            {
                "sub_chunk_bytes": sub or rt.options.sub_chunk_bytes,
                "in_flight": in_flight or rt.options.in_flight,
                "threads": t,
                "seconds": best,
                "cpu_seconds": cpu,
                "gbps": nbytes / best / 1e9,
                "overlap_over_bound": bound_s / best,
                "busy": busy,
                "correct": correct,
            }
        )
        print(
            f"  sub-chunk {show_bytes(runs[-1]['sub_chunk_bytes']):>9} in_flight "
            f"{runs[-1]['in_flight']:>2} threads {t:>2}: {runs[-1]['gbps']:7.2f} GB/s "
            f"({runs[-1]['overlap_over_bound']:.3f} of bound) busy "
            + " ".join(f"{k}={v:.2f}" for k, v in busy.items())
            + ("" if correct else "  WRONG RESULT"),
            flush=True,
        )
    overlap_chunks = None
    after = rt.stats()
    top = min(runs, key=lambda r: r["seconds"])
    overlap_s = top["seconds"]
    naive_best_t = min(naive_runs, key=naive_runs.get)
    gb = 1e9
    result = {
        "backend": backend,
        "workload": args.workload,
        "input": "pinned" if args.pinned_input else "pageable",
        "size_bytes": nbytes,
        "partition_bytes": rows_per_part * COLS * 4,
        "partitions": n_parts,
        "batch": args.batch,
        "sub_chunk_bytes": top["sub_chunk_bytes"],
        "in_flight": top["in_flight"],
        "threads": top["threads"],
        "staging_threads": rt.copy_threads,
        "out": args.out,
        "kernel_iterations": iterations,
        "ceilings_gbps": {k: v / gb for k, v in ceilings.items() if isinstance(v, float)},
        "stage_seconds": stages,
        "bound_stage": bound_stage,
        "naive_seconds_by_threads": naive_runs,
        "naive_gbps": nbytes / naive_runs[naive_best_t] / gb,
        "naive_threads": naive_best_t,
        "overlap_seconds": overlap_s,
        "overlap_cpu_seconds": top["cpu_seconds"],
        "overlap_gbps": nbytes / overlap_s / gb,
        "bound_gbps": nbytes / bound_s / gb,
        "overlap_over_bound": bound_s / overlap_s,
        "speedup_vs_naive": naive_runs[naive_best_t] / overlap_s,
        "correct": all(r["correct"] for r in runs),
        "pinned_fallbacks": after["pinned_fallbacks"] - before["pinned_fallbacks"],
        "backpressure_seconds": after["backpressure_seconds"] - before["backpressure_seconds"],
        "runs": runs,
    }
    rows_out = [
        (f"naive Dask (best threads={naive_best_t})", result["naive_gbps"]),
        (f"dask_overlap (best: threads={top['threads']})", result["overlap_gbps"]),
        (f"bound ({bound_stage})", result["bound_gbps"]),
    ]
    print(
        f"backend={backend} workload={args.workload} input={result['input']} "
        f"size={format_bytes(nbytes)} partition={format_bytes(result['partition_bytes'])} "
        f"partitions={n_parts} sub-chunk={show_bytes(top['sub_chunk_bytes'])} "
        f"in_flight={top['in_flight']}"
    )
    for label, gbps in rows_out:
        print(f"  {label:<40} {gbps:8.2f} GB/s")
    print(
        f"  overlap/bound {result['overlap_over_bound']:.3f}   "
        f"speedup vs naive {result['speedup_vs_naive']:.2f}x   correct={result['correct']}"
    )
    for note in caveats(backend, result["overlap_over_bound"]):
        print(f"  note: {note}")
    name = "overlap" if backend == "cuda" else f"overlap-{backend}"
    case = args.case or f"{args.workload}-{result['input']}"
    save(args, name, result, figures(result), device_name(backend), case=case)
    write_json(args.timeline_json, timeline or None)
    dask_overlap.close_runtimes()
    return result


def figures(result: dict[str, Any]) -> dict[str, Any]:
    """The headline numbers of a run (its history line)."""
    keys = ("size_bytes", "partition_bytes", "naive_gbps", "overlap_gbps", "bound_gbps")
    keys += ("bound_stage", "overlap_over_bound", "speedup_vs_naive", "correct")
    return {k: result[k] for k in keys}


if __name__ == "__main__":
    if sys.argv[1:2] == ["default"]:  # the script in its place, not imported
        script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bench_default.py")
        os.execv(sys.executable, [sys.executable, script, *sys.argv[2:]])
    main()
