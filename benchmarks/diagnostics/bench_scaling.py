"""Scaling over workers, one per GPU: weak (data grows with the workers) and strong (fixed).

Runs ``bench_cluster.run_one`` (``dask_overlap.map_blocks`` with ``split_axis=0`` and
``None`` on a :class:`~dask_overlap.LocalGPUCluster`) for each worker count, and reports
aggregate GB/s, GB/s per worker and the scaling efficiency (aggregate over N times the
one-worker figure). On a machine without enough GPUs, ``--backend timed --allow-cpu``
gives each worker its own modelled GPU engines: that checks the engine and the Dask side
(scheduler, placement), not PCIe or host memory bandwidth.

Example::

    python benchmarks/bench_scaling.py --workers 1,2 --size 1GiB --json out/scaling.json
"""

from __future__ import annotations

import argparse
import os
import sys

from dask.utils import format_bytes, parse_bytes

sys.path.insert(0, os.path.dirname(__file__))
from bench_cluster import run_one  # noqa: E402
from bench_overlap import comma_list, write_json  # noqa: E402


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", default="1,2", help="worker counts, a comma list")
    p.add_argument("--threads", type=int, default=2, help="threads per worker")
    p.add_argument("--size", default="1GiB", help="input bytes for one worker")
    p.add_argument("--partition", default="64MiB")
    p.add_argument("--sub-chunk", default=None)
    p.add_argument("--backend", default=None)
    p.add_argument("--allow-cpu", action="store_true")
    p.add_argument("--cuda-visible-devices", default=None)
    p.add_argument("--workload", default="balanced")
    p.add_argument("--repeat", type=int, default=1)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)

    counts = comma_list(args.workers, int)
    base = parse_bytes(args.size)
    out: dict = {"weak": [], "strong": []}
    calib = None
    for mode in ("weak", "strong"):
        for n in counts:
            run = argparse.Namespace(**vars(args))
            run.workers = n
            run.size = str(base * n if mode == "weak" else base)
            r = run_one(run, args.threads, calib)
            calib = {k: r[k] for k in ("ceilings_gbps", "kernel_seconds", "iterations")}
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
