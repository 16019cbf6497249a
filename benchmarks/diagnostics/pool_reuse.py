"""Does the device pool's reuse across streams hold partitions back? (issue 31: the 3-D
filter, whole partitions)

Partitions larger than the scratch cache's 32 MiB take their device memory from the RMM
resource, one allocation per input, per result and per temporary of ``func``, each on
the partition's own stream. With the resource the runtime makes by default (CUDA's
stream-ordered pool, ``overlap.device-memory-resource: auto``), the driver may give a
block freed on one stream to an allocation on another before that free has happened,
and make the second stream wait for the first (``cudaMemPoolReuseAllowInternalDependencies``,
on by default): a partition's kernel may then wait for another partition's copy. The 3-D
``gaussian_filter`` allocates two 256 MiB blocks a call where the elementwise kernel
allocates one, and it ran at 0.88 of the elementwise kernel on the same blocks on an H200
where the target is 0.9 (``limits.json``), though it staged and unstaged less (H100).

This runs the same work under three resources, each in a process of its own (a
process has one resource per device), the modes in turn, ``--rounds`` rounds:

- ``library``: the resource the runtime makes, as users get it;
- ``no-internal-deps``: the same kind of pool made here, of the size the runtime would
  make, with ``cudaMemPoolReuseAllowInternalDependencies`` off: a freed block goes to
  another stream only once its free has happened (``AllowOpportunistic``) or where the
  stream already waits for it (``FollowEventDependencies``); otherwise the pool grows;
- ``rmm-pool``: RMM's own pool (``overlap.device-memory-resource: pool``).

Each process, on pageable float32 input in ``--partition`` blocks with no other
setting (the path users run): the 3-D filter on a volume of 512 x 512 planes with no
split, the balanced kernel on the same blocks with no split and with ``split_axis=0``;
each after an untimed whole run, the best of ``--repeat``, compared element by element
with naive Dask + CuPy. It reports GB/s, each round's ratio to ``library``'s and their
median, and the resource's peak bytes (and, for the pool made here, the bytes it
reserved at most): what a policy that lets the pool grow costs in memory.

On the host backend there is no device pool, so only ``library`` runs there (a check
that the script works). Example::

    python3 benchmarks/diagnostics/pool_reuse.py --record
    python3 benchmarks/diagnostics/pool_reuse.py --backend host --size 64MiB --partition 8MiB
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
from typing import Any

import dask
import numpy as np

import dask_overlap
from dask_overlap.backends import resolve_backend
from dask_overlap.config import Options

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common import (  # noqa: E402
    COLS,
    GB,
    add_backend,
    add_output,
    add_repeat,
    array_of_views,
    best_persist,
    byte_count,
    comma_list,
    counted,
    device_name,
    gaussian_volume,
    make_kernel,
    measure_ceilings,
    naive,
    parser,
    persist_chunks,
    random_data,
    run_script,
    same_chunks,
    save,
    warm_then_time,
)

BENCHMARK = "pool-reuse"
MODES = ("library", "no-internal-deps", "rmm-pool")
#: A plane of the volume: 512 x 512 float32, 1 MiB (as bench_limits' gaussian3d).
PLANE = (512, 512)
THREADED = {"scheduler": "threads"}


def no_internal_deps_pool(size: int) -> Any:
    """A CUDA stream-ordered pool on device 0 as the runtime makes one (``size`` bytes at
    most, kept once grown, 2 GiB reserved at first), with reuse across streams through
    an inserted wait turned off; set as the device's RMM resource, so that the runtime
    takes it (it keeps a resource set before it). Returns the pool's handle."""
    import cupy
    import rmm
    from cuda.bindings import driver
    from cuda.bindings import runtime as cudart

    def ok(result: tuple) -> Any:
        err, *rest = result if isinstance(result, tuple) else (result,)
        if err != cudart.cudaError_t.cudaSuccess:
            raise RuntimeError(f"CUDA memory pool call failed: {err}")
        return rest[0] if rest else None

    cupy.cuda.Device(0).use()
    props = cudart.cudaMemPoolProps()
    props.allocType = cudart.cudaMemAllocationType.cudaMemAllocationTypePinned
    props.location.type = cudart.cudaMemLocationType.cudaMemLocationTypeDevice
    props.location.id = 0
    pool = ok(cudart.cudaMemPoolCreate(props))
    attr = cudart.cudaMemPoolAttr
    ok(cudart.cudaMemPoolSetAttribute(pool, attr.cudaMemPoolReuseAllowInternalDependencies, 0))
    threshold = driver.cuuint64_t(size)
    ok(cudart.cudaMemPoolSetAttribute(pool, attr.cudaMemPoolAttrReleaseThreshold, threshold))
    view = rmm.mr.CudaAsyncViewMemoryResource(pool)
    primed = rmm.DeviceBuffer(size=min(size, 2 << 30), mr=view)  # as initial_pool_size
    del primed
    limited = rmm.mr.LimitingResourceAdaptor(view, allocation_limit=size)
    rmm.mr.set_per_device_resource(0, rmm.mr.StatisticsResourceAdaptor(limited))
    return pool


def reserved_high(pool: Any) -> int:
    """The most bytes ``pool`` reserved from the device."""
    from cuda.bindings import runtime as cudart

    attr = cudart.cudaMemPoolAttr.cudaMemPoolAttrReservedMemHigh
    err, value = cudart.cudaMemPoolGetAttribute(pool, attr)
    return int(value) if err == cudart.cudaError_t.cudaSuccess else -1


def run_mode(args: argparse.Namespace) -> dict[str, Any]:
    """One process's work under ``args.mode``: every variant's best GB/s and what was
    counted over its timed runs."""
    pool = None
    if args.mode == "no-internal-deps":
        size = Options.from_config().device_pool_size  # the bound the runtime would set
        pool = no_internal_deps_pool(size)
    rt = dask_overlap.get_runtime(args.backend)  # no overlap.* setting but the mode's
    plane_bytes = 4 * PLANE[0] * PLANE[1]
    planes = max(1, args.partition // plane_bytes)
    host = random_data((max(planes, args.size // plane_bytes), *PLANE))
    x = array_of_views(host, planes)
    block = host[:planes].reshape(-1, COLS)  # the kernel measured as bench_limits does
    _, _, iterations = measure_ceilings(rt, block, "balanced")
    kernel = make_kernel(iterations)
    variants = {
        "filter": (gaussian_volume, None),
        "elementwise": (kernel, None),
        "elementwise_split": (kernel, 0),
    }
    out: dict[str, Any] = {"mode": args.mode, "variants": {}}
    refs: dict[Any, list] = {}
    for name, (fn, split) in variants.items():
        if fn not in refs:
            refs[fn] = warm_then_time(naive(x, fn), 1, **THREADED)[1]
        ours = dask_overlap.map_blocks(fn, x, split_axis=split, dtype=np.float32)
        persist_chunks(ours, **THREADED)  # untimed: the pools hold a run's memory
        before = rt.stats()
        seconds, got = best_persist(ours, args.repeat, **THREADED)
        out["variants"][name] = {
            "gbps": host.nbytes / seconds / GB,
            "correct": same_chunks(refs[fn], got),
            "counted": counted(before, rt.stats()),
        }
        del got
    if rt.name == "cuda":
        import rmm

        stats = rmm.mr.get_per_device_resource(0)
        counts = getattr(stats, "allocation_counts", None)  # a dict in older RMM
        peak = counts["peak_bytes"] if isinstance(counts, dict) else counts.peak_bytes
        out["device_peak_bytes"] = int(peak)
        if pool is not None:
            out["pool_reserved_high_bytes"] = reserved_high(pool)
    dask_overlap.close_runtimes()
    return out


def compare(rounds: list[dict[str, dict]]) -> dict[str, Any]:
    """Per mode and variant: GB/s of each round the mode ran in, the best, whether every
    run was right, and each round's ratio to ``library``'s (of the rounds both ran in)
    with their median. A mode whose process failed in every round has only its
    ``error``."""
    out: dict[str, Any] = {}
    for mode in rounds[0]:
        ran = [r for r in rounds if "error" not in r[mode]]
        if not ran:
            out[mode] = {"error": rounds[0][mode]["error"]}
            continue
        out[mode] = {}
        for variant in ran[0][mode]["variants"]:
            gbps = [r[mode]["variants"][variant]["gbps"] for r in ran]
            row: dict[str, Any] = {"gbps_each_round": gbps, "best_gbps": max(gbps)}
            both = [r for r in ran if "library" in r and "error" not in r["library"]]
            if both:
                row["over_library_each_round"] = [
                    r[mode]["variants"][variant]["gbps"] / r["library"]["variants"][variant]["gbps"]
                    for r in both
                ]
                row["over_library_median"] = statistics.median(row["over_library_each_round"])
            row["correct"] = all(r[mode]["variants"][variant]["correct"] for r in ran)
            out[mode][variant] = row
    return out


def arguments(argv: list[str] | None) -> argparse.Namespace:
    p = parser(__doc__)
    add_backend(p, "auto", ["auto", "cuda", "host"])
    p.add_argument("--size", type=byte_count, default="4GiB", help="input bytes")
    p.add_argument("--partition", type=byte_count, default="256MiB", help="bytes per block")
    p.add_argument(
        "--modes", default=None, help="a comma list of modes (default: all; library off CUDA)"
    )
    p.add_argument("--rounds", type=int, default=2, help="rounds of the modes in turn")
    add_repeat(p, 2, "of each variant in a process")
    p.add_argument("--mode", default=None, help=argparse.SUPPRESS)  # a child's one mode
    add_output(p)
    args = p.parse_args(argv)
    args.backend = resolve_backend(args.backend)
    if args.modes is None:  # every mode where there is a device pool, else the library's
        args.modes = ",".join(MODES) if args.backend == "cuda" else "library"
    modes = comma_list(args.modes, str)
    unknown = [m for m in modes if m not in MODES]
    if unknown or not modes:
        p.error(f"--modes: expected a comma list of {', '.join(MODES)}, got {args.modes!r}")
    if args.backend != "cuda" and modes != ["library"]:
        p.error(f"--modes: only library runs on the {args.backend} backend, got {args.modes!r}")
    args.modes = modes
    for name in ("rounds", "repeat"):
        if getattr(args, name) < 1:
            p.error(f"--{name}: expected an integer of at least 1, got {getattr(args, name)}")
    if args.partition < 4 * PLANE[0] * PLANE[1]:
        p.error(f"--partition: expected at least one 1 MiB plane, got {args.partition}")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = arguments(argv)
    if args.mode is not None:  # a child: one mode, its result to --json
        with dask.config.set({"overlap.backend": args.backend}):
            result = run_mode(args)
        save(args, BENCHMARK, result, {}, device_name(args.backend))
        return result
    common_argv = [
        "--backend", args.backend, "--size", str(args.size),
        "--partition", str(args.partition), "--repeat", str(args.repeat),
    ]  # fmt: skip
    rounds = []
    for r in range(args.rounds):
        got = {}
        for mode in args.modes:
            print(f"== round {r + 1}, {mode}", flush=True)
            env = {"DASK_OVERLAP__DEVICE_MEMORY_RESOURCE": "pool"} if mode == "rmm-pool" else {}
            try:
                got[mode] = run_script(__file__, [*common_argv, "--mode", mode], env=env)
            except subprocess.CalledProcessError as e:  # its output is above; the others run
                got[mode] = {"mode": mode, "error": f"its process exited with {e.returncode}"}
                print(f"  {mode}: {got[mode]['error']}", flush=True)
                continue
            for variant, v in got[mode]["variants"].items():
                print(f"  {variant:18s} {v['gbps']:7.2f} GB/s  correct={v['correct']}", flush=True)
        rounds.append(got)
    result = {
        "device": device_name(args.backend),
        "backend": args.backend,
        "size_bytes": args.size,
        "partition_bytes": args.partition,
        "modes": args.modes,
        "rounds": rounds,
        "compared": compare(rounds),
    }
    report(result)
    figures: dict[str, Any] = {}
    for mode, variants in result["compared"].items():
        if "error" in variants:
            figures[mode] = variants
            continue
        for variant, row in variants.items():
            kept = ("best_gbps", "over_library_median", "correct")
            figures[f"{mode}_{variant}"] = {k: row[k] for k in kept if k in row}
    save(args, BENCHMARK, result, figures, result["device"])
    return result


def report(result: dict[str, Any]) -> None:
    print(f"\n{result['device']}: {result['size_bytes'] / 2**30:.2f} GiB, by mode (best GB/s)")
    for mode, variants in result["compared"].items():
        if "error" in variants:
            print(f"  {mode:17s} did not run: {variants['error']}")
            continue
        for variant, row in variants.items():
            ratio = row.get("over_library_median")
            print(
                f"  {mode:17s} {variant:18s} {row['best_gbps']:7.2f}"
                + ("" if ratio is None else f"  x{ratio:.3f} of library (median of rounds)")
                + ("" if row["correct"] else "  WRONG")
            )
    for mode in result["modes"]:
        last = result["rounds"][-1][mode]
        peak, high = last.get("device_peak_bytes"), last.get("pool_reserved_high_bytes")
        if peak is not None:
            print(
                f"  {mode}: device peak {peak / 2**30:.2f} GiB"
                + ("" if high is None else f", pool reserved at most {high / 2**30:.2f} GiB")
            )


if __name__ == "__main__":
    main()
