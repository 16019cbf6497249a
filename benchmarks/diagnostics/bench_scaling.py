"""Scaling over workers, one per GPU: weak (data grows with the workers) and strong (fixed).

Runs ``bench_cluster.py`` (``dask_overlap.map_blocks`` with ``split_axis=0`` and ``None``
on a :class:`~dask_overlap.LocalGPUCluster`), in a process of its own, for each worker
count, with the kernel calibrated by the first run, and reports aggregate GB/s, GB/s per
worker and the scaling efficiency (aggregate over N times the one-worker figure). On a
machine without enough GPUs, ``--backend timed --allow-cpu`` gives each worker its own
modelled GPU engines: that checks the engine and the Dask side (scheduler, placement),
not PCIe or host memory bandwidth.

Example::

    python benchmarks/diagnostics/bench_scaling.py --workers 1,2 --size 1GiB --json out/scaling.json
"""

from __future__ import annotations

import argparse
import os
import sys

from dask.utils import format_bytes

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common import (  # noqa: E402
    BENCHMARKS,
    add_repeat,
    byte_count,
    comma_list,
    parser,
    run_script,
    write_json,
)


def run_cluster(args: argparse.Namespace, workers: int, size: int, iterations: int | None):
    """``bench_cluster.py`` on ``workers`` workers and ``size`` bytes: its one result."""
    argv = ["--workers", str(workers), "--threads", str(args.threads), "--size", str(size)]
    argv += ["--partition", args.partition, "--workload", args.workload]
    argv += ["--repeat", str(args.repeat)]
    for flag, value in (
        ("--sub-chunk", args.sub_chunk),
        ("--backend", args.backend),
        ("--cuda-visible-devices", args.cuda_visible_devices),
        ("--iterations", iterations),
    ):
        if value is not None:
            argv += [flag, str(value)]
    if args.allow_cpu:
        argv.append("--allow-cpu")
    (result,) = run_script(BENCHMARKS / "bench_cluster.py", argv)
    return result


def main(argv: list[str] | None = None) -> dict:
    p = parser(__doc__)
    p.add_argument("--workers", default="1,2", help="worker counts, a comma list")
    p.add_argument("--threads", type=int, default=2, help="threads per worker")
    p.add_argument("--size", type=byte_count, default="1GiB", help="input bytes for one worker")
    p.add_argument("--partition", default="64MiB")
    p.add_argument("--sub-chunk", default=None)
    p.add_argument("--backend", default=None)
    p.add_argument("--allow-cpu", action="store_true")
    p.add_argument("--cuda-visible-devices", default=None)
    p.add_argument("--workload", default="balanced")
    add_repeat(p, 1, "of each")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)

    counts = comma_list(args.workers, int)
    base = args.size
    out: dict = {"weak": [], "strong": []}
    iterations = None
    for mode in ("weak", "strong"):
        for n in counts:
            r = run_cluster(args, n, base * n if mode == "weak" else base, iterations)
            iterations = r["iterations"]
            gbps = r["gbps"]["split_axis=0"]
            out[mode].append(
                {
                    "workers": n,
                    "size_bytes": r["size_bytes"],
                    "gbps": gbps,
                    "correct": r["correct"],
                    "backend": r["backend"],
                }
            )
        one = out[mode][0]["gbps"] * (1 if counts[0] == 1 else 1 / counts[0])
        for row in out[mode]:
            row["per_worker_gbps"] = row["gbps"] / row["workers"]
            row["efficiency"] = row["gbps"] / (row["workers"] * one)
            print(
                f"{mode:6} workers={row['workers']} size={format_bytes(row['size_bytes'])} "
                f"backend={row['backend']}: {row['gbps']:.2f} GB/s, "
                f"{row['per_worker_gbps']:.2f} per worker, efficiency "
                f"{row['efficiency']:.2f}, correct={row['correct']}",
                flush=True,
            )
    write_json(args.json, out)
    return out


if __name__ == "__main__":
    main()
