"""Where the demo's cluster loses against the same partitions on the threaded scheduler.

Issue 31's demo row (``bench_limits.py --cases demo``) sets a ``LocalGPUCluster`` of one
worker against the threaded scheduler in one process, on the demo's partitions and
kernel. This runs the threaded reference, then clusters that differ from the demo's in
one thing each (``--variants``):

- ``as-is``: the demo's cluster;
- ``no-profiler``: distributed's statistical profiler off
  (``distributed.worker.profile.enabled``: it samples every thread's stack every 10 ms,
  holding the GIL);
- ``threads16``: 16 threads a worker, as many as the threaded scheduler's default;
- ``frozen``: ``gc.freeze()`` in the worker once the input is made (the library leaves
  worker processes alone: :func:`dask_overlap.pipeline.runtime.freeze_heap_once`);
- ``no-trim``: the worker started without ``MALLOC_TRIM_THRESHOLD_`` (distributed's
  nanny sets it to 64 KiB in every worker's environment, ``distributed.nanny.pre-spawn-environ``,
  and in its own process's ``os.environ`` before it spawns one: glibc then returns freed
  memory to the system at once, and keeps no dynamic mmap threshold, so that memory
  freed and asked for again is fresh, faulted in page by page. The threaded reference's
  process runs with glibc's defaults).

Each variant's runs are printed one by one, with the collector's passes in the worker
during them (``common.GcPauses``) and how many results the worker's result pool made over
memory used before and over fresh memory, and where the run's seconds went by the
worker's own records (``common.phases``: until its first task started, its tasks, a
thread's idle time between two of them, and after the last until the client knew), so
that a slow run can be told from a slow variant, and the scheduler's round trips from
the tasks' own time. As in the demo and its ``limits`` row, each run starts once the
worker has let the run before go (:func:`dask_overlap.demo.wait_released`), as one
process frees it at once.
Figures are GB/s of input; ratios are to the best threaded run of this call.

Run: ``python3 benchmarks/diagnostics/demo_gap.py --size 4GiB --repeat 5``.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time

import dask
import dask.array as da
from distributed import Client, wait

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common import (  # noqa: E402
    COLS,
    DEMO_KERNEL,
    GB,
    GcPauses,
    byte_count,
    comma_list,
    demo_input,
    demo_threaded,
    keys_of,
    persist_phased,
    persist_timed,
)

import dask_overlap  # noqa: E402
from dask_overlap.demo import scale_shift, summed_stats, wait_released  # noqa: E402

VARIANTS = ("as-is", "no-profiler", "threads16", "frozen", "no-trim")
TRIM = "MALLOC_TRIM_THRESHOLD_"  # what distributed's nanny sets in each worker


def _gc_watch_start() -> None:
    """(On the worker) count the collector's passes from now on. (This module is pickled
    by value, globals included: the counter is found again in ``gc.callbacks``.)"""
    GcPauses().__enter__()


def _gc_watch_stop() -> dict:
    """(On the worker) the passes since :func:`_gc_watch_start`."""
    (callback,) = [c for c in gc.callbacks if hasattr(getattr(c, "__self__", None), "summary")]
    pauses = callback.__self__
    pauses.__exit__(None, None, None)
    return pauses.summary()


def run_variant(variant: str, rows: int, rows_per_part: int, repeat: int) -> list[dict]:
    config: dict = {"distributed.worker.profile.enabled": variant != "no-profiler"}
    if variant == "no-trim":
        environ = dict(dask.config.get("distributed.nanny.pre-spawn-environ"))
        environ.pop(TRIM, None)
        config["distributed.nanny.pre-spawn-environ"] = environ
    threads = 16 if variant == "threads16" else None  # None: the demo's default
    runs = []
    # A nanny leaves its pre-spawn environment in this process's os.environ, which the
    # next worker started from here inherits: each variant starts from the environment
    # it names.
    os.environ.pop(TRIM, None)
    with (
        dask.config.set(config),
        dask_overlap.LocalGPUCluster(
            allow_cpu=True, dashboard_address=":0", threads_per_worker=threads
        ) as cluster,
        Client(cluster) as client,
    ):
        x = client.persist(demo_input(rows, rows_per_part))
        wait(x)
        trims = set(client.run(os.environ.get, TRIM).values())  # what the workers got
        if variant == "frozen":
            client.run(gc.freeze)
        warm = 2 * rows_per_part

        def run_of(i: int) -> da.Array:
            return dask_overlap.map_blocks(
                scale_shift, x, split_axis=0, token=f"gap-{variant}-{i}", **DEMO_KERNEL
            )

        wait_released(client, keys_of(persist_timed(run_of(0)[:warm], client)[1]))
        for i in range(repeat):
            client.run(_gc_watch_start)
            before = summed_stats(client)
            t0 = time.process_time()
            seconds, done, split = persist_phased(run_of(i + 1), client)
            gcs = list(client.run(_gc_watch_stop).values())[0]
            after = summed_stats(client)
            keys = keys_of(done)
            del done
            # As the demo and its row do: the next run starts once the worker has let this
            # one's results go (as one process frees them at once), not while the
            # scheduler is still telling it to.
            wait_released(client, keys)
            runs.append(
                {
                    "seconds": seconds,
                    "gc": gcs,
                    "client_cpu_s": time.process_time() - t0,
                    "worker_trim": sorted(map(str, trims)),
                    # results made over memory used before / fresh, in this run
                    **{
                        k: int(after.get(k, 0) - before.get(k, 0))
                        for k in ("results_reused", "results_fresh")
                    },
                    "computes": split.pop("computes"),
                    "phases": split,
                }
            )
        if variant == "frozen":
            client.run(gc.unfreeze)
    return runs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", type=byte_count, default="4GiB")
    p.add_argument("--partition", type=byte_count, default="256MiB")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--variants", type=lambda t: comma_list(t, str), default=",".join(VARIANTS))
    p.add_argument("--backend", default="auto")
    args = p.parse_args()
    rows, rows_per_part = args.size // (4 * COLS), args.partition // (4 * COLS)
    nbytes = rows * COLS * 4
    repeat = args.repeat
    threaded = demo_threaded(args.backend, repeat, rows, rows_per_part)[0]
    print(f"threaded scheduler, best of {repeat}: {threaded:.2f} GB/s")
    for variant in args.variants:
        if variant not in VARIANTS:
            raise SystemExit(f"--variants: one of {', '.join(VARIANTS)} expected; got {variant!r}")
        runs = run_variant(variant, rows, rows_per_part, repeat)
        each = [nbytes / r["seconds"] / GB for r in runs]
        print(
            f"{variant:12s} best {max(each):6.2f} GB/s ({max(each) / threaded:.3f} of threaded)"
            f" | each: {' '.join(f'{g:.2f}' for g in each)}"
        )
        for r, g in zip(runs, each, strict=True):
            print(
                f"    {g:6.2f} GB/s  worker gc passes {r['gc']['passes']} {r['gc']['ms']:.1f} ms"
                f"  {TRIM} {','.join(r['worker_trim'])}"
                f"  results reused {r['results_reused']} fresh {r['results_fresh']}"
            )
            print(
                "           "
                + "  ".join(
                    f"{k} {v:.3f}" if k == "busy" else f"{k} {v:.1f}"
                    for k, v in r["phases"].items()
                )
            )
    threaded_after = demo_threaded(args.backend, repeat, rows, rows_per_part)[0]
    print(f"threaded scheduler again: {threaded_after:.2f} GB/s")


if __name__ == "__main__":
    main()
