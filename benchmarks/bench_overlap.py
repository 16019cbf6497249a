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

import argparse
import itertools
import json
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import dask
import dask.array as da
import numpy as np
from dask.base import tokenize
from dask.highlevelgraph import HighLevelGraph
from dask.utils import format_bytes, parse_bytes

import dask_overlap
from dask_overlap.backends import resolve_backend

sys.path.insert(0, os.path.dirname(__file__))
from ceilings import measure_ceilings  # noqa: E402
from kernels import make_kernel  # noqa: E402

WORKLOADS = ("balanced", "transfer", "compute")
# Kernel time of one partition relative to that partition's H2D copy.
KERNEL_RATIO = {"balanced": 1.0, "transfer": 0.0, "compute": 3.0}


def write_json(path: str | None, data: Any) -> None:
    """Write ``data`` to ``path`` (creating its folder); nothing when ``path`` is None."""
    if path:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            json.dump(data, f, indent=2)


def comma_list(text: str, parse: Callable[[str], Any]) -> list:
    """``"a,b"`` parsed item by item; empty items skipped."""
    return [parse(t) for t in str(text).split(",") if t]


def show_bytes(n: int | str) -> str:
    """A byte count for people (``auto`` and other words as they are)."""
    return n if isinstance(n, str) else format_bytes(n)


def same_chunks(a: list[np.ndarray], b: list[np.ndarray]) -> bool:
    """Element-by-element equality of two lists of row blocks, whatever their cuts (a
    batch's blocks are several of the naive path's), without joining either."""
    i = j = at_a = at_b = 0
    while i < len(a) and j < len(b):
        n = min(len(a[i]) - at_a, len(b[j]) - at_b)
        if not np.array_equal(a[i][at_a : at_a + n], b[j][at_b : at_b + n]):
            return False
        at_a, at_b = at_a + n, at_b + n
        if at_a == len(a[i]):
            i, at_a = i + 1, 0
        if at_b == len(b[j]):
            j, at_b = j + 1, 0
    return all(len(x) == 0 for x in a[i:]) and all(len(y) == 0 for y in b[j:])


def engine_busy(spans: list, start: float, end: float) -> dict[str, float]:
    """Per stage, the fraction of ``[start, end]`` covered by at least one of its spans.

    A stream's span starts when the stream reaches it, which may be before its engine
    takes it up, so this is an upper bound on each engine's busy time: where it is low,
    that engine sat idle for certain.
    """
    out = {}
    for stage in sorted({s.stage for s in spans}):
        covered, reach = 0.0, start
        for s in sorted((s for s in spans if s.stage == stage), key=lambda s: s.start):
            lo, hi = max(s.start, reach), min(s.end, end)
            if hi > lo:
                covered += hi - lo
            reach = max(reach, s.end)
        out[stage] = covered / (end - start) if end > start else 0.0
    return out


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
    t0 = time.perf_counter()
    if threads:
        (done,) = dask.persist(arr, scheduler="threads", num_workers=threads)
    else:
        (done,) = dask.persist(arr, scheduler="sync")
    seconds = time.perf_counter() - t0
    graph = done.__dask_graph__()
    keys = dask.core.flatten(done.__dask_keys__())
    return seconds, [np.asarray(graph[k]) for k in keys]


def array_of_views(host: np.ndarray, rows_per_part: int) -> da.Array:
    """A dask array whose chunks are views of ``host`` (``from_array`` would copy them,
    and a copy of pinned input is pageable)."""
    name = f"input-{tokenize(host.shape, host.dtype, id(host))}"
    starts = range(0, host.shape[0], rows_per_part)
    dsk = {(name, i, 0): host[s : s + rows_per_part] for i, s in enumerate(starts)}
    chunks = (tuple(min(rows_per_part, host.shape[0] - s) for s in starts), (host.shape[1],))
    graph = HighLevelGraph.from_collections(name, dsk, dependencies=())
    return da.Array(graph, name, chunks, meta=np.empty((0, 0), host.dtype))


def pinned_copy(rt: Any, host: np.ndarray) -> np.ndarray:
    """``host`` copied into pinned memory: page-locked by CUDA on the GPU (outside the
    pool, as a user's pinned data would be), a block of the pool elsewhere."""
    if rt.name == "cuda":
        import cupyx

        pinned = cupyx.empty_pinned(host.shape, host.dtype)
    else:
        block = rt.backend.pinned.allocate(host.nbytes)
        if block is None:
            raise SystemExit("the pinned pool cannot hold the input; raise its size")
        pinned = block.view(host.dtype).reshape(host.shape)
    pinned[...] = host
    return pinned


def configure_timed(workload: str) -> None:
    """Model the workload's kernel on the timed backend (relative to its H2D rate)."""
    h2d = parse_bytes(str(dask.config.get("overlap.timed.h2d-bandwidth")))
    ratio = KERNEL_RATIO[workload]
    kernel_bw = h2d / ratio if ratio else h2d * 20
    dask.config.set({"overlap.timed.kernel-bandwidth": int(kernel_bw)})


def bound_seconds(
    total_in: int,
    total_out: int,
    kernel_s: float,
    ceilings: dict,
    staged: bool,
    unstaged: bool = False,
):
    """The slowest stage: each stage's bytes over its rate; ``stage`` names the winner.

    Staging in and unstaging out are host copies on the same threads: they count as one
    stage, the input at the staging rate, the results at the rate of copies into fresh
    memory (``fresh``), since every result is a new array.
    """
    stages = {
        "h2d": total_in / ceilings["h2d"],
        "d2h": total_out / ceilings["d2h"],
        "kernel": kernel_s,
    }
    if ceilings.get("both"):
        stages["both_ways"] = (total_in + total_out) / ceilings["both"]
    if (staged or unstaged) and ceilings.get("staging"):
        stages["host_copies"] = total_in * staged / ceilings["staging"] + total_out * unstaged / (
            ceilings.get("fresh") or ceilings["staging"]
        )
    if ceilings.get("host_cores"):
        # The host backend has no separate engines: every stage runs on the same cores.
        stages["host_cpu"] = sum(stages.values()) / ceilings["host_cores"]
    name = max(stages, key=stages.get)
    return stages[name], name, stages


def caveats(backend: str, over_bound: float) -> list[str]:
    """What a reader of the figures must know: the host backend is a correctness path,
    and the bound is a model, which a run can pass."""
    out = []
    if backend == "host":
        out.append(
            "the host backend is the correctness path, slower than plain NumPy: its "
            "'device' copies and kernels are host work on the same cores, so these figures "
            "say nothing of a GPU"
        )
    if over_bound > 1:
        out.append(
            f"overlap/bound {over_bound:.2f} > 1: the bound is the slowest stage at rates "
            "measured on their own (one partition, or 64 MiB of host copies), not a limit "
            "the run cannot pass (small copies, caches, or stages the model counts apart)"
        )
    return out


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", default="auto", choices=["auto", "cuda", "host", "timed"])
    p.add_argument("--workload", default="balanced", choices=WORKLOADS)
    p.add_argument("--size", default="256MiB", help="input bytes (float32)")
    p.add_argument("--partition", default="32MiB", help="bytes per Dask partition")
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
    p.add_argument("--repeat", type=int, default=1, help="timed runs of each path; best kept")
    p.add_argument(
        "--batch",
        type=lambda s: s if s == "auto" else int(s),
        default="auto",
        help="blocks joined per partition (map_blocks batch=; default: its default, auto)",
    )
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--timeline-json", default=None, help="write the fastest run's stage spans here")
    args = p.parse_args(argv)

    backend = resolve_backend(args.backend)
    size, part = parse_bytes(args.size), parse_bytes(args.partition)
    row = 1024  # float32 columns: 4 KiB rows
    rows, rows_per_part = max(1, size // (4 * row)), max(1, part // (4 * row))
    nbytes = rows * row * 4
    subs = comma_list(args.sub_chunk, parse_bytes) or [None]
    in_flights = comma_list(args.in_flight, int) or [None]
    threads = comma_list(args.threads, int) or [4]
    # Kept pinned blocks (results with --out pinned; pinned input off the GPU, where only
    # the pool's blocks count as pinned) may take half the pool; the ring has the rest.
    kept = nbytes * ((args.out == "pinned") + (args.pinned_input and backend != "cuda"))
    pool = int(2.1 * kept) + 2**30
    cfg = {
        "overlap.backend": backend,
        "overlap.pinned-pool-size": max(
            pool, parse_bytes(str(dask.config.get("overlap.pinned-pool-size")))
        ),
    }
    dask.config.set(cfg)
    if backend == "timed":
        configure_timed(args.workload)
    dask_overlap.close_runtimes()
    rt = dask_overlap.get_runtime(backend)

    rng = np.random.default_rng(0)
    host = rng.random((rows, row), dtype=np.float32)
    if args.pinned_input:
        host = pinned_copy(rt, host)

    ceilings, kernel_s_part, iterations = measure_ceilings(
        rt, host[:rows_per_part], args.workload, KERNEL_RATIO[args.workload], make_kernel
    )
    func = make_kernel(iterations)
    x = array_of_views(host, rows_per_part)
    n_parts = x.numblocks[0]
    kernel_s = kernel_s_part * rows / rows_per_part
    naive_threads = comma_list(args.naive_threads, int) or threads[:1]

    def naive_block(b: np.ndarray) -> np.ndarray:
        return rt.backend.naive(func, b)

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
    dask.persist(da.map_blocks(naive_block, warm, dtype=np.float32), scheduler="threads")
    for sub in subs:
        dask.persist(overlapped(warm, sub, in_flights[0]), scheduler="threads")

    naive = da.map_blocks(naive_block, x, dtype=np.float32)
    naive_runs = {}
    naive_chunks = None
    for t in naive_threads:
        best = float("inf")
        for _ in range(args.repeat):
            seconds, chunks = persist_seconds(naive, t)
            best = min(best, seconds)
            naive_chunks = chunks
            del chunks
        naive_runs[t] = best

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
        "partition_bytes": rows_per_part * row * 4,
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
    write_json(args.json, result)
    write_json(args.timeline_json, timeline or None)
    dask_overlap.close_runtimes()
    return result


if __name__ == "__main__":
    if sys.argv[1:2] == ["default"]:
        from bench_default import main as default_main

        default_main(sys.argv[2:])
    else:
        main()
