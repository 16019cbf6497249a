"""Benchmark: naive Dask copy-in/compute/copy-out against dask_overlap, beside the bound.

In one process and one run, after a warm-up, on the same data:

1. the naive Dask path: ``da.map_blocks`` whose function copies a block in, computes and
   copies it out, one step at a time (``runtime.backend.naive``);
2. ``dask_overlap.map_blocks`` with ``split_axis=0``;
3. the bound: the slowest stage at the measured (or, for ``timed``, modelled) rates.

Each is timed until every output chunk exists (``persist``), not to one concatenated
array (see DESIGN.md, Measuring). The two results are compared element by element.

Example::

    python benchmarks/bench_overlap.py --backend timed --workload balanced \\
        --size 512MiB --partition 64MiB --json bench-out/timed.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
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


def persist_seconds(arr: da.Array, threads: int) -> tuple[float, list[np.ndarray]]:
    """Seconds until every chunk of ``arr`` exists, and the chunks (in block order)."""
    t0 = time.perf_counter()
    (done,) = dask.persist(arr, scheduler="threads", num_workers=threads)
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


def configure_timed(workload: str) -> None:
    """Model the workload's kernel on the timed backend (relative to its H2D rate)."""
    h2d = parse_bytes(str(dask.config.get("overlap.timed.h2d-bandwidth")))
    ratio = KERNEL_RATIO[workload]
    kernel_bw = h2d / ratio if ratio else h2d * 20
    dask.config.set({"overlap.timed.kernel-bandwidth": int(kernel_bw)})


def bound_seconds(total_in: int, total_out: int, kernel_s: float, ceilings: dict, staged: bool):
    """The slowest stage: each stage's bytes over its rate; ``stage`` names the winner."""
    stages = {
        "h2d": total_in / ceilings["h2d"],
        "d2h": total_out / ceilings["d2h"],
        "kernel": kernel_s,
    }
    if ceilings.get("both"):
        stages["both_ways"] = (total_in + total_out) / ceilings["both"]
    if staged and ceilings.get("staging"):
        stages["staging"] = total_in / ceilings["staging"]
    if ceilings.get("host_cores"):
        # The host backend has no separate engines: every stage runs on the same cores.
        stages["host_cpu"] = sum(stages.values()) / ceilings["host_cores"]
    name = max(stages, key=stages.get)
    return stages[name], name, stages


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", default="auto", choices=["auto", "cuda", "host", "timed"])
    p.add_argument("--workload", default="balanced", choices=WORKLOADS)
    p.add_argument("--size", default="256MiB", help="input bytes (float32)")
    p.add_argument("--partition", default="32MiB", help="bytes per Dask partition")
    p.add_argument("--sub-chunk", default=None, help="bytes per sub-chunk (default: config)")
    p.add_argument("--in-flight", type=int, default=None)
    p.add_argument("--threads", type=int, default=4, help="Dask threads (partitions at once)")
    p.add_argument("--naive-threads", default="", help="comma list; default: --threads")
    p.add_argument("--pinned-input", action="store_true", help="input already in the pinned pool")
    p.add_argument("--repeat", type=int, default=1, help="timed runs of each path; best kept")
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args(argv)

    backend = resolve_backend(args.backend)
    size, part = parse_bytes(args.size), parse_bytes(args.partition)
    row = 1024  # float32 columns: 4 KiB rows
    rows, rows_per_part = max(1, size // (4 * row)), max(1, part // (4 * row))
    nbytes = rows * row * 4
    sub = parse_bytes(args.sub_chunk) if args.sub_chunk else None
    pool = int(nbytes * (2.2 if args.pinned_input else 1.2)) + 64 * 2**20
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
        block = rt.backend.pinned.allocate(host.nbytes)
        if block is None:
            raise SystemExit("the pinned pool cannot hold the input; raise its size")
        pinned = block.view(np.float32).reshape(host.shape)
        pinned[...] = host
        host = pinned

    ceilings, kernel_s_part, iterations = measure_ceilings(
        rt, host[:rows_per_part], args.workload, KERNEL_RATIO[args.workload], make_kernel
    )
    func = make_kernel(iterations)
    x = array_of_views(host, rows_per_part)
    n_parts = x.numblocks[0]
    kernel_s = kernel_s_part * rows / rows_per_part
    naive_threads = [int(t) for t in args.naive_threads.split(",") if t] or [args.threads]

    def naive_block(b: np.ndarray) -> np.ndarray:
        return rt.backend.naive(func, b)

    naive = da.map_blocks(naive_block, x, dtype=np.float32)
    overlap = dask_overlap.map_blocks(
        func, x, split_axis=0, sub_chunk_bytes=sub, in_flight=args.in_flight, dtype=np.float32
    )
    # Warm-up: compilation, pool creation and first touch stay out of the numbers.
    warm = x[: min(rows, 2 * rows_per_part)]
    dask.persist(da.map_blocks(naive_block, warm, dtype=np.float32), scheduler="threads")
    dask.persist(
        dask_overlap.map_blocks(
            func,
            warm,
            split_axis=0,
            sub_chunk_bytes=sub,
            in_flight=args.in_flight,
            dtype=np.float32,
        ),
        scheduler="threads",
    )

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
    before = rt.stats()
    overlap_s = float("inf")
    for _ in range(args.repeat):
        overlap_chunks = None
        seconds, overlap_chunks = persist_seconds(overlap, args.threads)
        overlap_s = min(overlap_s, seconds)
    after = rt.stats()
    correct = len(naive_chunks) == len(overlap_chunks) and all(
        np.array_equal(a, b) for a, b in zip(naive_chunks, overlap_chunks, strict=True)
    )
    staged = not args.pinned_input
    out_bytes = sum(c.nbytes for c in overlap_chunks)
    bound_s, bound_stage, stages = bound_seconds(nbytes, out_bytes, kernel_s, ceilings, staged)
    naive_best_t = min(naive_runs, key=naive_runs.get)
    gb = 1e9
    result = {
        "backend": backend,
        "workload": args.workload,
        "input": "pinned" if args.pinned_input else "pageable",
        "size_bytes": nbytes,
        "partition_bytes": rows_per_part * row * 4,
        "partitions": n_parts,
        "sub_chunk_bytes": sub or rt.options.sub_chunk_bytes,
        "in_flight": args.in_flight or rt.options.in_flight,
        "threads": args.threads,
        "kernel_iterations": iterations,
        "ceilings_gbps": {k: v / gb for k, v in ceilings.items() if isinstance(v, float)},
        "stage_seconds": stages,
        "bound_stage": bound_stage,
        "naive_seconds_by_threads": naive_runs,
        "naive_gbps": nbytes / naive_runs[naive_best_t] / gb,
        "naive_threads": naive_best_t,
        "overlap_seconds": overlap_s,
        "overlap_gbps": nbytes / overlap_s / gb,
        "bound_gbps": nbytes / bound_s / gb,
        "overlap_over_bound": bound_s / overlap_s,
        "speedup_vs_naive": naive_runs[naive_best_t] / overlap_s,
        "correct": bool(correct),
        "pinned_fallbacks": after["pinned_fallbacks"] - before["pinned_fallbacks"],
        "backpressure_seconds": after["backpressure_seconds"] - before["backpressure_seconds"],
    }
    rows_out = [
        (f"naive Dask (best threads={naive_best_t})", result["naive_gbps"]),
        ("dask_overlap", result["overlap_gbps"]),
        (f"bound ({bound_stage})", result["bound_gbps"]),
    ]
    print(
        f"backend={backend} workload={args.workload} input={result['input']} "
        f"size={format_bytes(nbytes)} partition={format_bytes(result['partition_bytes'])} "
        f"partitions={n_parts} threads={args.threads}"
    )
    for label, gbps in rows_out:
        print(f"  {label:<36} {gbps:8.2f} GB/s")
    print(
        f"  overlap/bound {result['overlap_over_bound']:.3f}   "
        f"speedup vs naive {result['speedup_vs_naive']:.2f}x   correct={correct}"
    )
    write_json(args.json, result)
    dask_overlap.close_runtimes()
    return result


if __name__ == "__main__":
    main()
