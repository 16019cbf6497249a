"""Benchmark: dask_overlap on a LocalGPUCluster, by threads per worker, with and without split_axis.

For each ``--threads`` value a fresh :class:`~dask_overlap.LocalGPUCluster` (one worker
per GPU, or ``--workers`` sharing them) makes a float32 input on the workers, warms up,
then times, until every output chunk exists (``persist``), ``dask_overlap.map_blocks``
with ``split_axis=0`` (overlap inside and across partitions) and with
``split_axis=None`` (overlap across partitions only). The kernel is calibrated once, on
a worker, to take ``ratio`` times one partition's H2D copy (the ``balanced`` workload
takes as long as the copy). Results are checked element by element against each other
and against ``dask.array.map_blocks`` on the host.

Example (issue 4's GPU check, on one H200)::

    python benchmarks/bench_cluster.py --threads 1,2,4 --size 8GiB --partition 256MiB
    python benchmarks/bench_cluster.py --threads 1,2,4 --workers 2 --size 8GiB  # 2 on 1 GPU
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

import dask.array as da
import numpy as np
from dask.utils import format_bytes
from distributed import Client, wait

import dask_overlap
from dask_overlap.cluster.local import plan_workers

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (  # noqa: E402
    COLS,
    WORKLOADS,
    add_output,
    add_repeat,
    byte_count,
    comma_list,
    make_kernel,
    measure_ceilings,
    naive,
    parser,
    persist_timed,
    runtime_device,
    save,
)


def calibrate(block: np.ndarray, workload: str) -> dict[str, Any]:
    """Run on a worker: its runtime's ceilings and the kernel iterations for ``workload``."""
    rt = dask_overlap.get_runtime()
    ceilings, kernel_s, iterations = measure_ceilings(rt, block, workload)
    rates = {k: v / 1e9 for k, v in ceilings.items() if isinstance(v, float)}
    return {"ceilings_gbps": rates, "kernel_seconds": kernel_s, "iterations": iterations}


def run_one(args: argparse.Namespace, threads: int, calib: dict | None) -> dict[str, Any]:
    rows = max(1, args.size // (4 * COLS))
    rows_per_part = max(1, args.partition // (4 * COLS))
    nbytes = rows * COLS * 4
    layout = plan_workers(
        args.workers, cuda_visible_devices=args.cuda_visible_devices, allow_cpu=args.allow_cpu
    )
    # The workers' pools as configured: results are ordinary arrays filled through the
    # pinned ring, which needs no sizing for what Dask holds.
    kw: dict[str, Any] = {}
    if getattr(args, "backend", None):
        kw["backend"] = args.backend
    with (
        dask_overlap.LocalGPUCluster(
            args.workers,
            threads,
            cuda_visible_devices=args.cuda_visible_devices,
            allow_cpu=args.allow_cpu,
            dashboard_address=None,
            **kw,
        ) as cluster,
        Client(cluster) as client,
    ):
        x = da.random.default_rng(0).random(
            (rows, COLS), chunks=(rows_per_part, COLS), dtype=np.float32
        )
        x = client.persist(x)
        wait(x)
        if calib is None:
            block = client.compute(x.blocks[0])
            calib = client.submit(calibrate, block, args.workload, pure=False).result()
        func = make_kernel(calib["iterations"])
        sub = args.sub_chunk

        def variant(split: int | None, arr: da.Array) -> da.Array:
            return dask_overlap.map_blocks(
                func, arr, split_axis=split, sub_chunk_bytes=sub, dtype=np.float32
            )

        warm = x[: min(rows, 2 * rows_per_part * len(cluster.workers))]
        for split in (0, None):
            wait(client.persist(variant(split, warm)))

        # The reference: each worker's naive path (copy in, compute, copy out on its
        # backend), so both sides run the same kernel on the same device.
        reference = naive(x, func)
        seconds: dict[str, float] = {}
        correct = True
        for split in (0, None):
            name = f"split_axis={split}"
            seconds[name] = float("inf")
            for _ in range(args.repeat):
                s, done = persist_timed(variant(split, x), client=client)
                seconds[name] = min(seconds[name], s)
                correct &= bool(client.compute((done == reference).all(), sync=True))
                del done  # frees its pinned outputs before the next run
        stats = client.run(dask_overlap.runtime_stats)
        device = client.submit(runtime_device, pure=False).result()

    out = {
        "threads_per_worker": threads,
        "workers": layout.n_workers,
        "devices": list(layout.devices),
        "backend": kw.get("backend", layout.options.backend),
        "device": device,
        "size_bytes": nbytes,
        "partition_bytes": rows_per_part * COLS * 4,
        "partitions": -(-rows // rows_per_part),
        "seconds": seconds,
        "gbps": {k: nbytes / v / 1e9 for k, v in seconds.items()},
        "correct": correct,
        "pinned_fallbacks": sum(s["pinned_fallbacks"] for s in stats.values()),
        "backpressure_seconds": sum(s["backpressure_seconds"] for s in stats.values()),
        **calib,
    }
    return out


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    p = parser(__doc__)
    p.add_argument("--threads", default="1,2,4", help="threads per worker, a comma list")
    p.add_argument("--workers", type=int, default=None, help="default: one per GPU")
    p.add_argument("--cuda-visible-devices", default=None, help="GPUs to use (default: all)")
    p.add_argument("--allow-cpu", action="store_true", help="CPU workers when there is no GPU")
    p.add_argument(
        "--backend", default=None, help="workers' backend (default: config; timed models a GPU)"
    )
    p.add_argument("--workload", default="balanced", choices=WORKLOADS)
    p.add_argument("--size", type=byte_count, default="1GiB", help="input bytes (float32)")
    p.add_argument("--partition", type=byte_count, default="64MiB", help="bytes per Dask partition")
    p.add_argument("--sub-chunk", default=None, help="bytes per sub-chunk (default: config)")
    p.add_argument(
        "--iterations", type=int, default=None, help="kernel length (default: calibrated)"
    )
    add_repeat(p, 2, "of each variant")
    add_output(p)
    args = p.parse_args(argv)

    results: list[dict[str, Any]] = []
    calib = None
    if args.iterations is not None:  # e.g. another run's calibration, for the same kernel
        calib = {"ceilings_gbps": {}, "kernel_seconds": None, "iterations": args.iterations}
    for t in comma_list(args.threads, int):
        r = run_one(args, t, calib)
        calib = {k: r[k] for k in ("ceilings_gbps", "kernel_seconds", "iterations")}
        results.append(r)
        g = r["gbps"]
        print(
            f"workers={r['workers']} threads={t} backend={r['backend']} "
            f"size={format_bytes(r['size_bytes'])} partitions={r['partitions']}: "
            f"split_axis=0 {g['split_axis=0']:.2f} GB/s, split_axis=None "
            f"{g['split_axis=None']:.2f} GB/s, correct={r['correct']}, "
            f"fallbacks={r['pinned_fallbacks']}",
            flush=True,
        )
    name = "cluster" if args.workers is None else f"cluster-{args.workers}-workers"
    save(args, name, results, figures(results), results[0]["device"] if results else "none")
    return results


def figures(results: list[dict[str, Any]]) -> dict[str, Any]:
    """The headline numbers of a run (its history line): GB/s by threads per worker."""
    out: dict[str, Any] = {k: results[0][k] for k in ("workers", "size_bytes")} if results else {}
    for r in results:
        out[f"threads={r['threads_per_worker']}"] = {**r["gbps"], "correct": r["correct"]}
    return out


if __name__ == "__main__":
    main()
