"""Issue 31's evidence: every row of its table in one call, on one card, each beside its
bound or its reference.

One process, float32 input made by the benchmark, every figure GB/s of input until every
output chunk exists (``persist``; on the cluster ``distributed.wait``), each case warmed up
just before it is timed, every result compared element by element with plain Dask's (the
naive Dask + CuPy path, the same function on NumPy blocks on the host backend; the demo's
as the demo checks it, to an ulp on the GPU). The
runtime is built from a case's settings (the pinned pool's size, where results stay in
it) and built again when the next case's differ. The cases (``--cases`` runs a subset)
and the rows they write:

- ``default`` (rows ``default_split``, ``default_nosplit``): the path users run, no
  ``overlap.*`` setting, pageable input in ``--partition`` partitions, the balanced
  kernel (as long as one partition's H2D), ``dask_overlap.map_blocks(f, x,
  split_axis=0)`` and without a split, Dask's threaded scheduler with its own threads
  (``--default-threads`` sets them),
  against the hand-written pipeline with no Dask (``common.handwritten_runs``: its best
  over ``--hand-in-flight`` and ``--hand-threads``; CUDA only, the naive path elsewhere);
  the two run in turn, ``--repeat`` pairs, each row the best of its runs;
  ``default_split`` has ``over_nosplit`` (best over best), ``over_nosplit_pairs`` (each
  pair's) and their median;
- ``gaussian1d``: ``gaussian_filter1d`` along rows (cupyx on the GPU, SciPy on the CPU)
  with defaults and ``split_axis=0``, against the naive path (``ratio``: the speed-up);
- ``gaussian3d``: a 3-D ``gaussian_filter`` (sigma 2, no halo) on a volume of 512 x 512
  planes in ``--partition`` blocks, ``dask_overlap.map_blocks`` with no split, against
  the default path's elementwise figure on the same blocks (the balanced kernel, no
  split), each after an untimed whole run, with what the runtime ``counted`` over each
  one's timed runs and their CPU time by thread; also the filter alone on one block
  resident on the device;
- ``demo``: the demo's run (``python -m dask_overlap demo``): a ``LocalGPUCluster`` with
  its defaults, input made on the workers in ``--partition`` chunks (the demo's own at
  4 GiB: a sixteenth), the demo's kernel with ``split_axis=0``, each best of ``--repeat``,
  against the same partitions on the default path in this process (Dask's threaded
  scheduler), the two run in turn (each round's ratio in ``ratio_pairs``), with what each
  scheduler costs a call on the same blocks with no work (``cluster_noop_seconds``,
  ``threaded_noop_seconds``); ``over_default_split`` beside it when ``default`` ran too;
- ``small`` (rows ``small_<partition>_<out>``): as ``ci/gpu.sh small`` does: the balanced
  kernel on pinned input in each ``--small`` partition size, every setting at its default
  (``batch="auto"``), ``out="host"`` and ``out="pinned"``, ``--small-threads`` Dask
  threads (the best kept), against the bound;
- ``pinned``: the opt-in pinned path, as ``bench_overlap.py``'s balanced-pinned case:
  ``--pinned-size`` of pinned input (``--size`` unless given; issue 31's row names 8 GiB,
  every run recorded so far used 4), ``out="pinned"``, ``--threads`` Dask threads, a pool
  that holds the results, ``--pinned-repeat`` runs, each reported in ``runs`` (with each
  stage's share of its wall, ``engine_busy``, what the runtime ``counted`` over it, and
  whose CPU time it used, ``thread_cpu_seconds``); the row's ``gbps`` and ``ratio`` are the slowest
  run's (the target holds for every run);
- ``compute``: the same with a kernel three times one partition's H2D, the best run.

The bound of a row is its slowest stage at rates measured in this run
(``common.bound_seconds``: both ways at once on the GPU, the kernel's own time, the host's
copies; ``stages_gbps`` gives each stage's). The rows whose bound is both ways at once
also have ``copy_only_gbps``: the input copied in and out alone, partition by partition
on two streams, over the whole run (``common.copy_only_seconds``, the best before and
after the runs), and each run's ``ratio_to_copy_only``: the bound's both-ways rate is one
partition's best burst, which a whole run of copies alone may not sustain. Every row has
``gbps``, ``reference_gbps`` and ``reference`` (what it is) or ``bound_gbps`` and
``bound_stage``, ``ratio`` (``gbps`` over either) and ``correct``; the result has
``device``. ``--record`` writes ``benchmarks/results/limits.json`` and a line of
``history.jsonl``.

The defaults are meant to fit ``ci/gpu.sh limits`` (540 s) on an H200; ``case_seconds``
says what each case took. Example (the GPU; a smoke test on the CPU)::

    python3 benchmarks/bench_limits.py --record
    python3 benchmarks/bench_limits.py --backend host --size 16MiB --partition 4MiB \\
        --small 1MiB=8MiB --cases default,small
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import dask
import dask.array as da
import numpy as np
from dask.system import CPU_COUNT
from dask.utils import format_bytes

import dask_overlap
from dask_overlap.backends import resolve_backend

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (  # noqa: E402
    COLS,
    DEMO_KERNEL,
    GB,
    GcPauses,
    add_backend,
    add_output,
    add_repeat,
    array_of_views,
    best_persist,
    bound_seconds,
    byte_count,
    comma_list,
    copy_only_seconds,
    counted,
    demo_input,
    demo_reference,
    device_name,
    engine_busy,
    equals_plain_dask,
    gaussian_case,
    gaussian_volume,
    handwritten_runs,
    keys_of,
    make_kernel,
    measure_ceilings,
    naive,
    noop_seconds,
    pair_ratios,
    parser,
    persist_chunks,
    persist_in_turn,
    persist_phased,
    persist_timed,
    pinned_copy,
    pinned_pool_size,
    positive,
    random_data,
    rows_of,
    same_chunks,
    save,
    thread_cpu,
    thread_cpu_since,
    turns,
    warm_then_time,
    warm_up,
)

BENCHMARK = "limits"
#: A plane of the 3-D volume: 512 x 512 float32, 1 MiB.
PLANE = (512, 512)
THREADED = {"scheduler": "threads"}


# -- rows --------------------------------------------------------------------------------


def against_reference(
    gbps: float, reference_gbps: float, reference: str, correct: bool, **extra: Any
) -> dict[str, Any]:
    """A row whose figure is set against another path's (``reference`` says which)."""
    return {
        "gbps": gbps,
        "reference_gbps": reference_gbps,
        "reference": reference,
        "ratio": gbps / reference_gbps,
        "correct": bool(correct),
        **extra,
    }


def against_bound(
    gbps: float, bound_gbps: float, bound_stage: str, correct: bool, **extra: Any
) -> dict[str, Any]:
    """A row whose figure is set against the bound (its slowest stage, ``bound_stage``)."""
    return {
        "gbps": gbps,
        "bound_gbps": bound_gbps,
        "bound_stage": bound_stage,
        "ratio": gbps / bound_gbps,
        "correct": bool(correct),
        **extra,
    }


_CALIBRATED: dict[tuple, tuple[dict, float, int]] = {}


def calibrated(rt: Any, block: np.ndarray, workload: str) -> tuple[Callable, dict, float]:
    """The benchmarks' kernel for ``workload`` on partitions like ``block``, the stage
    rates and its seconds per partition (``common.measure_ceilings``), measured once per
    backend, shape and workload in this run."""
    key = (rt.name, block.shape, workload)
    if key not in _CALIBRATED:
        _CALIBRATED[key] = measure_ceilings(rt, block, workload)
    ceilings, kernel_s, iterations = _CALIBRATED[key]
    return make_kernel(iterations), ceilings, kernel_s


# -- the default path --------------------------------------------------------------------


def case_default(args: argparse.Namespace) -> dict[str, dict]:
    """``default_split`` and ``default_nosplit`` against the hand-written pipeline."""
    rt = dask_overlap.get_runtime(args.backend)  # no overlap.* setting
    host = random_data((rows_of(args.size), COLS))
    rows_per_part = rows_of(args.partition)
    func, _, _ = calibrated(rt, host[:rows_per_part], "balanced")
    x = array_of_views(host, rows_per_part)
    threaded = dict(THREADED)
    if args.default_threads is not None:
        threaded["num_workers"] = args.default_threads
    naive_s, ref = warm_then_time(naive(x, func), 1, **threaded)
    arrays = {
        name: dask_overlap.map_blocks(func, x, split_axis=split, dtype=np.float32)
        for name, split in (("default_split", 0), ("default_nosplit", None))
    }
    # The two in turn, run for run: a drift of the machine's speed (a 4 GiB run takes a
    # quarter of a second) weighs on both alike, and each pair gives a ratio. First one
    # whole run, not timed (as bench_default.py's): each timed run then follows a run whose
    # results were let go, with the result pool holding their memory, where the first
    # timed run would otherwise find it empty and pay fresh memory that the rest do not.
    warm_up(*arrays.values(), **threaded)
    persist_chunks(arrays["default_split"], **threaded)
    seconds, correct = persist_in_turn(
        arrays, args.repeat, lambda got: same_chunks(ref, got), **threaded
    )
    figures = {name: (host.nbytes / min(t) / GB, correct[name]) for name, t in seconds.items()}
    extra: dict[str, Any] = {"naive_gbps": host.nbytes / naive_s / GB}
    if rt.name == "cuda":
        hand = handwritten_runs(
            host, func, ref, args.hand_in_flight, args.hand_threads, args.repeat
        )
        top = max(hand, key=lambda h: h["gbps"])
        base = top["gbps"]
        what = f"hand-written pipeline, {top['in_flight']} in flight, {top['threads']} threads"
        extra["handwritten"] = hand
        extra["reference_correct"] = all(h["ok"] for h in hand)
    else:
        base, what = extra["naive_gbps"], "naive Dask (the hand-written pipeline is CUDA only)"
    rows = {
        name: against_reference(gbps, base, what, ok, **extra)
        for name, (gbps, ok) in figures.items()
    }
    vs = pair_ratios(seconds["default_split"], seconds["default_nosplit"])
    rows["default_split"]["over_nosplit"] = vs["best"]
    rows["default_split"]["over_nosplit_pairs"] = vs["pairs"]
    rows["default_split"]["over_nosplit_median"] = vs["median"]
    for row in rows.values():
        row["dask_threads"] = args.default_threads or CPU_COUNT
    return rows


def case_gaussian1d(args: argparse.Namespace) -> dict[str, dict]:
    """``gaussian_filter1d`` along rows with defaults against the naive path."""
    g = gaussian_case(args.size, rows_of(args.partition), args.repeat)
    row = against_reference(
        g["default_gbps"],
        g["naive_gbps"],
        "naive Dask + CuPy (the ratio is the speed-up)",
        g["correct"],
        nosplit_gbps=g["nosplit_gbps"],
    )
    return {"gaussian1d": row}


# -- a real filter on whole partitions ---------------------------------------------------


def filter_alone_gbps(block: np.ndarray, backend: str, repeat: int = 3) -> float:
    """:func:`gaussian_volume` on ``block`` already on the device (on the host backend,
    in host memory): GB/s of its bytes, the best of ``repeat`` after a first call."""
    if backend == "cuda":
        import cupy

        data = cupy.asarray(block)
        sync = cupy.cuda.Device().synchronize
    else:
        data, sync = block, (lambda: None)
    gaussian_volume(data)  # compilation, the pool's first blocks
    sync()
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        gaussian_volume(data)
        sync()
        best = min(best, time.perf_counter() - t0)
    return block.nbytes / best / GB


def case_gaussian3d(args: argparse.Namespace) -> dict[str, dict]:
    """The 3-D filter with no split against the elementwise kernel on the same blocks."""
    rt = dask_overlap.get_runtime(args.backend)  # no overlap.* setting
    plane_bytes = 4 * PLANE[0] * PLANE[1]
    host = random_data((rows_of(args.size, plane_bytes), *PLANE))
    per_block = rows_of(args.partition, plane_bytes)
    x = array_of_views(host, per_block)
    block = host[:per_block]
    alone = filter_alone_gbps(block, rt.name)
    func, _, _ = calibrated(rt, block.reshape(-1, COLS), "balanced")
    seconds, correct, runtime_counted = {}, {}, {}
    for name, fn in (("filter", gaussian_volume), ("elementwise", func)):
        naive_s, ref = warm_then_time(naive(x, fn), 1, **THREADED)
        seconds[f"{name}_naive"] = naive_s
        ours = dask_overlap.map_blocks(fn, x, dtype=np.float32)  # no split: whole blocks
        warm_up(ours, **THREADED)
        # One whole run, not timed: each variant's timed runs then start with the result
        # pool holding a run's memory. Without it the filter, timed first, made 14 of the
        # 32 results of its two runs in fresh memory, the elementwise kernel after it none
        # (H100, 2026-12-06).
        persist_chunks(ours, **THREADED)
        before, threads0 = rt.stats(), thread_cpu()
        seconds[name], got = best_persist(ours, args.repeat, **THREADED)
        runtime_counted[name] = counted(before, rt.stats())  # over its timed runs
        # whose CPU time they took: the filter's Python (cupyx builds its weights and
        # launches three passes a call) runs on the task threads, under the GIL
        runtime_counted[name]["thread_cpu_seconds"] = thread_cpu_since(threads0)
        correct[name] = same_chunks(ref, got)
        del ref, got
    gbps = {k: host.nbytes / s / GB for k, s in seconds.items()}
    row = against_reference(
        gbps["filter"],
        gbps["elementwise"],
        "the default path's elementwise figure: the balanced kernel on the same blocks, no split",
        correct["filter"],
        reference_correct=correct["elementwise"],
        naive_gbps=gbps["filter_naive"],
        filter_alone_gbps=alone,
        volume_shape=list(host.shape),
        block_bytes=block.nbytes,
        counted=runtime_counted,
    )
    return {"gaussian3d": row}


# -- the demo ----------------------------------------------------------------------------


def case_demo(args: argparse.Namespace) -> dict[str, dict]:
    """The demo's LocalGPUCluster run against the same partitions on the threaded scheduler,
    their runs in turn."""
    from distributed import Client, wait

    from dask_overlap.demo import naive_scale_shift, scale_shift, wait_released

    rows, rows_per_part = rows_of(args.size), rows_of(args.partition)
    nbytes = rows * COLS * 4
    # The reference is made and warmed up in this process before the cluster starts, and
    # its runs then alternate with the cluster's (A B, B A, ...): the machine's speed
    # drifts within a call (demo_gap.py, H100: the reference ran 13.9 GB/s at the start of
    # a call and 16.1 at its end), and a reference timed only before the cluster put that
    # drift into the row's ratio.
    reference, ref_x = demo_reference(args.backend, rows, rows_per_part)
    gpu = dask_overlap.get_runtime(args.backend).name == "cuda"
    with (
        dask_overlap.LocalGPUCluster(
            allow_cpu=True, dashboard_address=":0", threads_per_worker=args.demo_threads
        ) as cluster,
        Client(cluster) as client,
    ):
        x = client.persist(demo_input(rows, rows_per_part))  # made on the workers
        wait(x)
        warm = 2 * rows_per_part
        naive_arr = da.map_blocks(naive_scale_shift, x, **DEMO_KERNEL)

        def run_of(x: da.Array, i: int) -> da.Array:
            # Keys of its own for each run, as the demo's: the scheduler lets a dropped
            # result go a moment later, and a run that asks for keys still in memory
            # finds them there and times nothing (4 GiB "in" 2.5 ms on an H100).
            return dask_overlap.map_blocks(
                scale_shift, x, split_axis=0, token=f"scale_shift-run{i}", **DEMO_KERNEL
            )

        # Each result is let go, and the worker has dropped it, before the next run starts,
        # as the demo does (and as the threaded reference's are, in one process).
        wait_released(client, keys_of(persist_timed(naive_arr[:warm], client)[1]))
        naive_s, done = persist_timed(naive_arr, client)
        keys, done = keys_of(done), None
        wait_released(client, keys)
        wait_released(client, keys_of(persist_timed(run_of(x, 0)[:warm], client)[1]))
        seconds: dict[str, list[float]] = {"demo": [], "reference": []}
        cluster_phases = []  # where each cluster run's seconds went (common.phases)
        done = ref_done = None  # the last run of each is checked
        for i, name in turns(seconds, args.repeat):
            if name == "reference":
                ref_done = None  # let go before the next run, as the cluster's are
                s, ref_done = persist_timed(reference, scheduler="threads")
            else:
                if done is not None:
                    keys, done = keys_of(done), None
                    wait_released(client, keys)
                s, done, split = persist_phased(run_of(x, i + 1), client)
                cluster_phases.append(split)
            seconds[name].append(s)
        backends = {s["backend"] for s in client.run(dask_overlap.runtime_stats).values()}
        correct = equals_plain_dask(done, x, backends == {"cuda"})
        nthreads = client.nthreads()
        del done
        # What each scheduler costs a call on these blocks with no work in the tasks (the
        # graph to the scheduler, the tasks to the worker, the results back): a floor
        # under each side's seconds that is not the library's.
        cluster_noop = noop_seconds(x, args.repeat, "cluster", client)
        del x
    threaded_noop = noop_seconds(ref_x, args.repeat, "threads", scheduler="threads")
    with dask.config.set(scheduler="threads"):  # the reference's check stays in this process
        reference_ok = equals_plain_dask(ref_done, ref_x, gpu)
    del ref_done, reference, ref_x
    vs = pair_ratios(seconds["demo"], seconds["reference"])
    row = against_reference(
        nbytes / min(seconds["demo"]) / GB,
        nbytes / min(seconds["reference"]) / GB,
        "the same partitions and kernel on the default path in this process (threaded "
        "scheduler), run in turn with the cluster's",
        correct,
        reference_correct=reference_ok,
        ratio_pairs=vs["pairs"],
        ratio_median=vs["median"],
        seconds=min(seconds["demo"]),
        reference_seconds=min(seconds["reference"]),
        cluster_noop_seconds=cluster_noop,
        threaded_noop_seconds=threaded_noop,
        # each cluster run, in order: until its first task started, its tasks, a thread's
        # idle time between two tasks, after its last task until the client knew (ms)
        cluster_phases=cluster_phases,
        naive_gbps=nbytes / naive_s / GB,
        speedup_vs_naive=naive_s / min(seconds["demo"]),
        workers=len(nthreads),
        threads_per_worker=max(nthreads.values()),
        worker_backends=sorted(backends),
    )
    return {"demo": row}


# -- the bound: pinned input -------------------------------------------------------------


def pinned_runs(
    args: argparse.Namespace,
    workload: str,
    out: str,
    size: int,
    partition: int,
    threads: list[int],
    repeat: int,
) -> dict[str, Any]:
    """As ``bench_overlap.py --pinned-input --out OUT`` (``split_axis=0``, every other
    setting at its default, the pool large enough to hold what ``out`` keeps): every
    timed run (``repeat`` for each of ``threads``) with its ratio to the bound, and the
    bound."""
    rows, rows_per_part = rows_of(size), rows_of(partition)
    nbytes = rows * COLS * 4
    pool = pinned_pool_size(nbytes, out, True, args.backend)
    with dask.config.set({"overlap.pinned-pool-size": pool}):
        rt = dask_overlap.get_runtime(args.backend)
        host = pinned_copy(rt, random_data((rows, COLS)))
        func, ceilings, kernel_s = calibrated(rt, host[:rows_per_part], workload)
        bound_s, stage, stages = bound_seconds(
            nbytes, nbytes, kernel_s * rows / rows_per_part, ceilings, False, out == "host"
        )
        x = array_of_views(host, rows_per_part)
        naive_s, ref = warm_then_time(naive(x, func), 1, **THREADED)
        arr = dask_overlap.map_blocks(func, x, split_axis=0, dtype=np.float32, out=out)
        # What the copies alone sustain, where both ways at once is the bound (not for
        # results out to pageable memory, nor for a kernel that sets the pace).
        copy_s = copy_only_seconds(host, rows_per_part) if stage == "both_ways" else None
        runs = []
        for t in threads:
            warm_up(arr, scheduler="threads", num_workers=t)
            for _ in range(repeat):
                got = None  # the last run's results leave the pool first
                before, threads0 = rt.stats(), thread_cpu()
                rt.timeline.clear()
                start, cpu0 = time.time(), time.process_time()
                with GcPauses() as pauses:
                    seconds, got = persist_chunks(arr, scheduler="threads", num_workers=t)
                cpu = time.process_time() - cpu0
                runs.append(
                    {
                        "threads": t,
                        "gbps": nbytes / seconds / GB,
                        "ratio": bound_s / seconds,
                        "host_us_per_partition": cpu / x.numblocks[0] * 1e6,
                        "correct": same_chunks(ref, got),
                        "gc": pauses.summary(),
                        # each stage's share of the run's wall (an upper bound of its
                        # engine's) and what the runtime counted over it
                        "engine_busy": engine_busy(list(rt.timeline), start, start + seconds),
                        "counted": counted(before, rt.stats()),
                        # whose CPU time it was, by thread (a slow run's extra CPU time
                        # went somewhere: H100, 10-12 ms a partition against about 5)
                        "thread_cpu_seconds": thread_cpu_since(threads0),
                    }
                )
            del got
    copies = {}
    if copy_s is not None:  # the same copies after the runs too: the machine may drift
        copy_s = min(copy_s, copy_only_seconds(host, rows_per_part) or copy_s)
        copies["copy_only_gbps"] = nbytes / copy_s / GB
        copies["ratio_to_copy_only"] = [r["gbps"] / copies["copy_only_gbps"] for r in runs]
    return {
        "runs": runs,
        **copies,
        "bound_gbps": nbytes / bound_s / GB,
        "bound_stage": stage,
        "stages_gbps": {k: nbytes / v / GB for k, v in stages.items() if v > 0},
        "naive_gbps": nbytes / naive_s / GB,
        "size_bytes": nbytes,
        "partition_bytes": rows_per_part * COLS * 4,
        "partitions": x.numblocks[0],
    }


def bound_row(measured: dict[str, Any], pick: Callable) -> dict[str, Any]:
    """A row of :func:`pinned_runs`: the run ``pick`` chooses (``min`` or ``max`` by GB/s)."""
    runs = measured["runs"]
    chosen = pick(runs, key=lambda r: r["gbps"])
    extra = {k: v for k, v in measured.items() if k not in ("bound_gbps", "bound_stage")}
    return against_bound(
        chosen["gbps"],
        measured["bound_gbps"],
        measured["bound_stage"],
        all(r["correct"] for r in runs),
        threads=chosen["threads"],
        host_us_per_partition=chosen["host_us_per_partition"],
        **extra,
    )


def case_pinned(args: argparse.Namespace) -> dict[str, dict]:
    """The opt-in pinned path, every run of ``--pinned-repeat``; the row is the slowest."""
    measured = pinned_runs(
        args,
        "balanced",
        "pinned",
        args.pinned_size or args.size,
        args.partition,
        args.threads,
        args.pinned_repeat,
    )
    row = bound_row(measured, min)
    row["ratio_each_run"] = [r["ratio"] for r in measured["runs"]]
    row["best_gbps"] = max(r["gbps"] for r in measured["runs"])
    return {"pinned": row}


def case_compute(args: argparse.Namespace) -> dict[str, dict]:
    """A kernel three times a partition's H2D on the pinned path; the best run."""
    measured = pinned_runs(
        args, "compute", "pinned", args.size, args.partition, args.threads, args.repeat
    )
    return {"compute": bound_row(measured, max)}


def case_small(args: argparse.Namespace) -> dict[str, dict]:
    """Each ``--small`` partition size, ``out="host"`` then ``out="pinned"``."""
    rows = {}
    for out in ("host", "pinned"):
        for partition, size in args.small:
            name = f"small_{format_bytes(partition).replace(' ', '').replace('.00', '')}_{out}"
            measured = pinned_runs(
                args, "balanced", out, size, partition, args.small_threads, args.repeat
            )
            rows[name] = bound_row(measured, max)
    return rows


# -- the run -----------------------------------------------------------------------------

#: In this order, so that cases with the same settings follow each other.
CASES: dict[str, Callable[[argparse.Namespace], dict[str, dict]]] = {
    "default": case_default,
    "gaussian1d": case_gaussian1d,
    "gaussian3d": case_gaussian3d,
    "demo": case_demo,
    "small": case_small,
    "pinned": case_pinned,
    "compute": case_compute,
}


def small_sizes(text: str) -> list[tuple[int, int]]:
    """An argparse type: ``PARTITION=SIZE`` pairs, a comma list (``16MiB=2GiB,4MiB=1GiB``)."""
    pairs = []
    for item in comma_list(text, str):
        partition, sep, size = item.partition("=")
        if not sep:
            raise argparse.ArgumentTypeError(
                f"expected PARTITION=SIZE pairs such as 16MiB=2GiB, got {item!r}"
            )
        pairs.append((byte_count(partition), byte_count(size)))
    return pairs


def arguments(argv: list[str] | None) -> argparse.Namespace:
    p = parser(__doc__)
    add_backend(p, "auto", ["auto", "cuda", "host"])
    p.add_argument("--size", type=byte_count, default="4GiB", help="input bytes of the large cases")
    p.add_argument(
        "--partition", type=byte_count, default="256MiB", help="bytes per partition (large cases)"
    )
    p.add_argument(
        "--small",
        type=small_sizes,
        default="16MiB=2GiB,4MiB=1GiB",
        help="small partitions and their input bytes, PARTITION=SIZE pairs",
    )
    add_repeat(p, 2)
    p.add_argument("--pinned-repeat", type=positive, default=3, help="runs of the pinned case")
    p.add_argument(
        "--pinned-size",
        type=byte_count,
        default=None,
        help="input bytes of the pinned case [--size] (issue 31's row: 8GiB)",
    )
    p.add_argument("--threads", default="4", help="Dask threads of the pinned and compute cases")
    p.add_argument("--small-threads", default="4,8", help="Dask threads of the small cases")
    p.add_argument(
        "--default-threads",
        type=positive,
        default=None,
        help="threads of the default case's scheduler (default: Dask's, one per core)",
    )
    p.add_argument(
        "--demo-threads",
        type=positive,
        default=None,
        help="threads of the demo's worker (default: LocalGPUCluster's)",
    )
    p.add_argument("--hand-in-flight", default="8", help="hand-written: chunks in flight")
    p.add_argument("--hand-threads", default="16", help="hand-written: copy threads")
    p.add_argument("--cases", default=",".join(CASES), help="a comma list of cases to run")
    add_output(p)
    args = p.parse_args(argv)
    cases = comma_list(args.cases, str)
    unknown = [c for c in cases if c not in CASES]
    if unknown or not cases:
        p.error(f"--cases: expected a comma list of {', '.join(CASES)}, got {args.cases!r}")
    if args.repeat < 1:
        p.error(f"--repeat: expected an integer of at least 1, got {args.repeat}")
    args.cases = [c for c in CASES if c in cases]
    for name in ("size", "partition"):
        if getattr(args, name) < 1:
            p.error(f"--{name}: expected a byte count of at least 1, got {getattr(args, name)}")
    for name in ("threads", "small_threads", "hand_in_flight", "hand_threads"):
        flag, text = f"--{name.replace('_', '-')}", getattr(args, name)
        try:
            setattr(args, name, comma_list(text, positive))
        except argparse.ArgumentTypeError as e:
            p.error(f"{flag}: {e}")
        if not getattr(args, name):
            p.error(f"{flag}: expected a comma list of integers of at least 1, got {text!r}")
    args.backend = resolve_backend(args.backend)
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = arguments(argv)
    rows: dict[str, dict] = {}
    case_seconds = {}
    with dask.config.set({"overlap.backend": args.backend}):
        for name in args.cases:
            print(f"== {name}", flush=True)
            t0 = time.perf_counter()
            done = CASES[name](args)
            case_seconds[name] = time.perf_counter() - t0
            for row_name, row in done.items():  # as it comes: a run cut short still says it
                print(row_line(row_name, row), flush=True)
            rows.update(done)
        dask_overlap.close_runtimes()
    if "default_split" in rows:
        for name in ("demo", "gaussian3d"):
            if name in rows:
                rows[name]["over_default_split"] = (
                    rows[name]["gbps"] / rows["default_split"]["gbps"]
                )
    result = {
        "device": device_name(args.backend),
        "backend": args.backend,
        "size_bytes": args.size,
        "partition_bytes": args.partition,
        "cases": args.cases,
        "case_seconds": case_seconds,
        "rows": rows,
    }
    report(result)
    save(args, BENCHMARK, result, figures(result), result["device"])
    return result


def report(result: dict[str, Any]) -> None:
    """Every row on a line: GB/s, what it is set against, the ratio, the check."""
    print(f"\n{result['device']} ({result['backend']}): {format_bytes(result['size_bytes'])}")
    for name, r in result["rows"].items():
        print(row_line(name, r))
    for line in cpu_lines(result["rows"]):
        print(line)
    total = sum(result["case_seconds"].values())
    print(
        f"  ({total:.0f} s: "
        + ", ".join(f"{k} {v:.0f}" for k, v in result["case_seconds"].items())
        + ")"
    )


def cpu_lines(rows: dict[str, dict]) -> list[str]:
    """Whose CPU time the pinned path's slowest run and each gaussian3d variant's timed
    runs took, the three threads that took most (see ``thread_cpu_seconds``).

    Examples
    --------
    >>> runs = [{"gbps": 40.0, "thread_cpu_seconds": {"a": 0.5}},
    ...         {"gbps": 30.0, "thread_cpu_seconds": {"b": 1.0, "a": 0.25}}]
    >>> cpu_lines({"pinned": {"runs": runs}})
    ['  pinned slowest run, CPU s by thread: b 1.00, a 0.25']
    """

    def top(spent: dict[str, float]) -> str:
        found = ", ".join(f"{k} {v:.2f}" for k, v in list(spent.items())[:3])
        return found or "none a clock tick long"

    lines = []
    runs = rows.get("pinned", {}).get("runs")
    if runs and "thread_cpu_seconds" in runs[0]:
        slowest = min(runs, key=lambda r: r["gbps"])
        lines.append(f"  pinned slowest run, CPU s by thread: {top(slowest['thread_cpu_seconds'])}")
    for variant, got in rows.get("gaussian3d", {}).get("counted", {}).items():
        if "thread_cpu_seconds" in got:
            lines.append(
                f"  gaussian3d {variant}, CPU s by thread: {top(got['thread_cpu_seconds'])}"
            )
    return lines


def row_line(name: str, r: dict[str, Any]) -> str:
    """A row for people: GB/s, what it is set against, the ratio, the check."""
    against = (
        f"bound {r['bound_gbps']:7.2f} ({r['bound_stage']})"
        if "bound_gbps" in r
        else f"reference {r['reference_gbps']:7.2f}"
    )
    copies = ""
    if "copy_only_gbps" in r:  # copies alone, over the run's length (copy_only_seconds)
        copies = f"  copies alone {r['copy_only_gbps']:.2f} GB/s"
    return (
        f"  {name:<20} {r['gbps']:7.2f} GB/s  {against:<30} ratio {r['ratio']:.3f}  "
        f"correct={r['correct']}{copies}"
    )


def figures(result: dict[str, Any]) -> dict[str, Any]:
    """The headline numbers of a run (its history line): each row's figure, what it is
    set against, the ratio and the check."""
    keys = ("gbps", "reference_gbps", "bound_gbps", "ratio", "correct", "ratio_each_run")
    keys += ("copy_only_gbps", "ratio_to_copy_only")
    return {name: {k: r[k] for k in keys if k in r} for name, r in result["rows"].items()}


if __name__ == "__main__":
    main()
