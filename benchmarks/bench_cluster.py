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
import time
from typing import Any

import dask.array as da
import numpy as np
from dask.utils import format_bytes, parse_bytes
from distributed import Client, wait

import dask_overlap
from dask_overlap.cluster.local import plan_workers

sys.path.insert(0, os.path.dirname(__file__))
from bench_overlap import KERNEL_RATIO, WORKLOADS, comma_list, write_json  # noqa: E402
from ceilings import measure_ceilings  # noqa: E402
from kernels import make_kernel  # noqa: E402

COLS = 1024  # float32 columns: 4 KiB rows


def calibrate(block: np.ndarray, workload: str) -> dict[str, Any]:
    """Run on a worker: its runtime's ceilings and the kernel iterations for ``workload``."""
    rt = dask_overlap.get_runtime()
    ceilings, kernel_s, iterations = measure_ceilings(
        rt, block, workload, KERNEL_RATIO[workload], make_kernel
    )
    rates = {k: v / 1e9 for k, v in ceilings.items() if isinstance(v, float)}
    return {"ceilings_gbps": rates, "kernel_seconds": kernel_s, "iterations": iterations}


def persist_seconds(client: Client, arr: da.Array) -> tuple[float, da.Array]:
    t0 = time.perf_counter()
    done = client.persist(arr)
    wait(done)
    return time.perf_counter() - t0, done


def _naive(block: np.ndarray, kernel: Any) -> np.ndarray:
    return dask_overlap.get_runtime().backend.naive(kernel, block)


def run_one(args: argparse.Namespace, threads: int, calib: dict | None) -> dict[str, Any]:
    size, part = parse_bytes(args.size), parse_bytes(args.partition)
    rows, rows_per_part = max(1, size // (4 * COLS)), max(1, part // (4 * COLS))
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
        reference = da.map_blocks(_naive, x, kernel=func, dtype=np.float32)
        seconds: dict[str, float] = {}
        correct = True
        for split in (0, None):
            name = f"split_axis={split}"
            seconds[name] = float("inf")
            for _ in range(args.repeat):
                s, done = persist_seconds(client, variant(split, x))
                seconds[name] = min(seconds[name], s)
                correct &= bool(client.compute((done == reference).all(), sync=True))
                del done  # frees its pinned outputs before the next run
        stats = client.run(dask_overlap.runtime_stats)

    out = {
        "threads_per_worker": threads,
        "workers": layout.n_workers,
        "devices": list(layout.devices),
        "backend": kw.get("backend", layout.options.backend),
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
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", default="1,2,4", help="threads per worker, a comma list")
    p.add_argument("--workers", type=int, default=None, help="default: one per GPU")
    p.add_argument("--cuda-visible-devices", default=None, help="GPUs to use (default: all)")
    p.add_argument("--allow-cpu", action="store_true", help="CPU workers when there is no GPU")
    p.add_argument(
        "--backend", default=None, help="workers' backend (default: config; timed models a GPU)"
    )
    p.add_argument("--workload", default="balanced", choices=WORKLOADS)
    p.add_argument("--size", default="1GiB", help="input bytes (float32)")
    p.add_argument("--partition", default="64MiB", help="bytes per Dask partition")
    p.add_argument("--sub-chunk", default=None, help="bytes per sub-chunk (default: config)")
    p.add_argument("--repeat", type=int, default=2, help="timed runs of each variant; best kept")
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args(argv)

    results: list[dict[str, Any]] = []
    calib = None
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
    write_json(args.json, results)
    return results


if __name__ == "__main__":
    main()
