"""Small partitions against the bound: throughput and host time per partition.

Issue 12's GPU benchmark. For each partition size: the balanced workload on pinned
input, every other setting at its default (results are ordinary arrays, filled through
the ring, or straight for sub-chunks under ``direct-bytes``), run by ``bench_overlap.py``
in a process of its own (its ceilings, its bound, its check against the naive path).
Per size it reports ``overlap_gbps``, ``bound_gbps``, ``overlap_over_bound`` and
``host_us_per_partition``: the process's CPU time over the best run (every thread: the
task threads, the copy threads, the stream waiters), per partition.

``--direct-off`` runs the sizes at or under ``direct-bytes`` a second time with
``direct-bytes: 0`` (every sub-chunk through the ring), to show what skipping it gains.
Every size runs with ``map_blocks``'s default ``batch="auto"`` (blocks under 64 MiB
joined into partitions of about 64 MiB, the output cut back into the blocks); ``--batch
1,4`` runs each size again with ``map_blocks(..., batch=k)`` (1: a partition a block; k:
k blocks joined per partition, the output's blocks k times larger), on the same machine.
``--profile N`` prints the top N functions of one run at ``--profile-size`` (cProfile,
on the synchronous scheduler, so that the profiler sees the tasks).

Example (on the GPU machine)::

    python3 benchmarks/diagnostics/small_partitions.py --record
"""

from __future__ import annotations

import argparse
import os
import sys

from dask.utils import format_bytes, parse_bytes

from dask_overlap import Options
from dask_overlap.pipeline.runtime import EVERY_SUB_CHUNK, resolve_direct_bytes

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common import (  # noqa: E402
    BENCHMARKS,
    add_backend,
    add_output,
    device_name,
    parser,
    run_script,
    save,
)

#: Partition size -> total input bytes (enough partitions to reach a steady state).
SIZES = {"256MiB": "4GiB", "16MiB": "2GiB", "4MiB": "1GiB", "1MiB": "512MiB", "256KiB": "128MiB"}


def bench(argv: list[str], env: dict[str, str] | None = None, profile: int = 0) -> dict:
    """``bench_overlap.py`` with ``argv``, in a process of its own: its result."""
    return run_script(BENCHMARKS / "bench_overlap.py", argv, env, profile)


def case(
    partition: str,
    size: str,
    args: argparse.Namespace,
    batch: int | str = "auto",
    env: dict[str, str] | None = None,
) -> dict:
    argv = [
        "--backend", args.backend, "--workload", "balanced", "--pinned-input",
        "--size", size, "--partition", partition, "--threads", args.threads,
        "--repeat", str(args.repeat), "--out", args.out, "--batch", str(batch),
    ]  # fmt: skip
    r = bench(argv, env)
    return {
        "partition_bytes": r["partition_bytes"],
        "partitions": r["partitions"],
        "batch": batch,
        "threads": r["threads"],
        "overlap_gbps": r["overlap_gbps"],
        "bound_gbps": r["bound_gbps"],
        "bound_stage": r["bound_stage"],
        "overlap_over_bound": r["overlap_over_bound"],
        "host_us_per_partition": r["overlap_cpu_seconds"] / r["partitions"] * 1e6,
        "naive_gbps": r["naive_gbps"],
        "correct": r["correct"],
    }


def direct_bytes(backend: str) -> float:
    """``overlap.direct-bytes`` as ``backend`` applies it (``auto`` resolved)."""
    host_memory = backend == "host"
    found = resolve_direct_bytes(Options.from_config().direct_bytes, host_memory)
    return float("inf") if found == EVERY_SUB_CHUNK else found


def main(argv: list[str] | None = None) -> dict:
    p = parser(__doc__)
    add_backend(p, "cuda", ["cuda", "host", "timed"])
    p.add_argument("--sizes", default=",".join(SIZES), help="partition sizes, a comma list")
    p.add_argument("--threads", default="4,8", help="Dask threads, a comma list (best kept)")
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument(
        "--out",
        default="host",
        choices=["host", "pinned"],
        help="map_blocks out=",
    )
    p.add_argument("--direct-off", action="store_true", help="also run with direct-bytes 0")
    p.add_argument(
        "--batch",
        default="",
        help="also run each size with map_blocks batch= each of these (a comma list)",
    )
    p.add_argument("--profile", type=int, default=0, help="print the top N functions")
    p.add_argument("--profile-size", default="16MiB", help="the partition size profiled")
    add_output(p)
    args = p.parse_args(argv)

    sizes = [s.strip() for s in args.sizes.split(",") if s.strip()]
    result: dict = {"device": device_name(args.backend), "out": args.out, "sizes": {}}
    for part in sizes:
        size = SIZES.get(part) or format_bytes(parse_bytes(part) * 256).replace(" ", "")
        result["sizes"][part] = row = case(part, size, args)
        if args.direct_off and parse_bytes(part) * 2 <= direct_bytes(args.backend):
            ring = {"DASK_OVERLAP__DIRECT_BYTES": "0"}  # overlap.direct-bytes: 0
            row["through_the_ring"] = case(part, size, args, env=ring)
        for k in (int(b) for b in args.batch.split(",") if b.strip()):
            row[f"batch_{k}"] = case(part, size, args, k)
    print(f"\n{result['device']}: balanced, pinned input, out={args.out}, default settings")
    print(f"{'partition':>10} {'GB/s':>7} {'bound':>7} {'of bound':>9} {'host us/part':>13}")
    for part, r in result["sizes"].items():
        batches = [(f" batch {k[6:]}", r[k]) for k in r if k.startswith("batch_")]
        for label, x in [(part, r), (" ring", r.get("through_the_ring")), *batches]:
            if x is not None:
                print(
                    f"{label:>10} {x['overlap_gbps']:7.2f} {x['bound_gbps']:7.2f} "
                    f"{x['overlap_over_bound']:9.3f} {x['host_us_per_partition']:13.0f}"
                )
    if args.profile:
        profile(args.profile_size, SIZES.get(args.profile_size, "1GiB"), args)
    save(args, "small-partitions", result, figures(result), result["device"], f"out_{args.out}")
    return result


def figures(result: dict) -> dict:
    """The headline numbers of a run (its history line): per size and variant, GB/s, the
    fraction of the bound and host µs per partition."""
    keys = ("overlap_gbps", "overlap_over_bound", "host_us_per_partition", "correct")
    out = {}
    for part, row in result["sizes"].items():
        out[part] = {k: row[k] for k in keys}
        for variant in (k for k in row if k == "through_the_ring" or k.startswith("batch_")):
            out[f"{part} {variant}"] = {k: row[variant][k] for k in keys}
    return out


def profile(partition: str, size: str, args: argparse.Namespace) -> None:
    """cProfile of one run on the synchronous scheduler (one thread, so that the profiler
    sees the tasks; the copy threads and stream waiters it does not)."""
    bench(["--backend", args.backend, "--workload", "balanced", "--pinned-input",
           "--size", size, "--partition", partition, "--threads", "0", "--out", args.out],
          profile=args.profile)  # fmt: skip


if __name__ == "__main__":
    main()
