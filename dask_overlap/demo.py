"""The demo (the README's main job): a real array through a real cluster, checked.

It starts a :class:`~dask_overlap.LocalGPUCluster` on this machine with its defaults (one
worker per GPU; on a machine with no GPU, CPU workers on the host backend), makes a
float32 array on the workers, runs the usual Dask + CuPy code
(``cp.asnumpy(f(cp.asarray(block)))``) and then ``dask_overlap.map_blocks`` with
``split_axis=0`` and no other setting over it, checks every element against plain
``dask.array.map_blocks``, and prints both throughputs side by side, the backend used, the
dashboard address, and what dask_overlap did in the last timed run: how many partitions the
chunks became (``batch="auto"`` joins small ones), the sub-chunks and the bytes copied.
What it prints is counted by the workers' runtimes, over the last timed run only (an
untimed warm-up runs first). ``--repeat N`` times each path N times, each run under keys of
its own (so no run is served from a result Dask still holds), alternating which path goes
first, each run's result let go by the workers before the next run starts (as a run in
one process frees it at once), and reports the medians and their ratio.
``python -m dask_overlap demo --help`` lists the knobs.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import statistics
import time
from typing import TYPE_CHECKING, Any

import dask.config
import numpy as np
from dask.utils import format_bytes, parse_bytes

from .cluster.local import CPU_WORKERS, THREADS_PER_WORKER

if TYPE_CHECKING:
    import dask.array as da
    from distributed import Client

__all__ = ["main", "naive_scale_shift", "scale_shift", "summed_stats", "wait_released"]

_COLS = 1024  # float32 columns: a row is 4 KiB, and partitions are whole rows


def scale_shift(block: Any, scale: float, shift: float, rounds: int) -> Any:
    """An elementwise kernel that runs on NumPy and CuPy blocks alike (row-independent)."""
    result = block * block.dtype.type(scale) + block.dtype.type(shift)
    for _ in range(rounds):
        result = result * block.dtype.type(0.5) + block
    return result


def naive_scale_shift(block: Any, **kw: Any) -> Any:
    """The usual Dask + CuPy code: copy in, compute, copy out, one step at a time (on the
    CPU path, just the kernel)."""
    from dask_overlap.backends import gpu_available

    if not gpu_available():
        return scale_shift(block, **kw)
    import cupy

    return cupy.asnumpy(scale_shift(cupy.asarray(block), **kw))


@dataclasses.dataclass(frozen=True)
class _DemoSetup:
    """What the demo runs: the array and its partitions, the kernel, the cluster's shape."""

    gpu: bool
    rows: int
    rows_per_chunk: int
    sub_chunk: str | None  # None: overlap.sub-chunk-bytes
    workers: int | None  # None: LocalGPUCluster's default
    threads: int | None  # None: LocalGPUCluster's default
    rounds: int
    keep_open: float
    repeat: int = 1

    @property
    def nbytes(self) -> int:
        return self.rows * _COLS * 4

    @property
    def chunk_bytes(self) -> int:
        return min(self.rows_per_chunk, self.rows) * _COLS * 4

    @property
    def chunks(self) -> int:
        return -(-self.rows // self.rows_per_chunk)

    @property
    def kernel_kw(self) -> dict[str, Any]:
        return {"scale": 2.5, "shift": 1.0, "rounds": self.rounds}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="dask overlap demo",
        description="Run dask_overlap.map_blocks on a local cluster and check it against Dask.",
    )
    sub_chunk = dask.config.get("overlap.sub-chunk-bytes")
    p.add_argument(
        "--size", type=_rows_bytes, default=None, help="input bytes (default 256MiB; 4GiB on a GPU)"
    )
    p.add_argument(
        "--chunk",
        "--partition",
        type=_rows_bytes,
        default=None,
        help="bytes per Dask chunk of the input (default size/16); batch='auto' may run "
        "small chunks several to a partition",
    )
    p.add_argument(
        "--sub-chunk",
        type=_sub_chunk,
        default=None,
        help=f"bytes per sub-chunk (default overlap.sub-chunk-bytes, now {sub_chunk})",
    )
    p.add_argument(
        "--workers",
        type=_positive,
        default=None,
        help=f"default: one per GPU; {CPU_WORKERS} on a machine with no GPU",
    )
    p.add_argument(
        "--threads",
        type=_positive,
        default=None,
        help=f"partitions in flight per worker (default {THREADS_PER_WORKER} per GPU; on a "
        "machine with no GPU, its cores shared among the workers)",
    )
    p.add_argument(
        "--rounds", type=_at_least(0), default=2, help="kernel length (elementwise passes)"
    )
    p.add_argument(
        "--repeat",
        type=_positive,
        default=1,
        metavar="N",
        help="time each path N times (fresh keys each run) and report the medians (default 1)",
    )
    p.add_argument(
        "--keep-open",
        type=_seconds,
        default=0.0,
        metavar="SECONDS",
        help="keep the cluster (and its dashboard) up this long after the run",
    )
    return p


def _at_least(least: int) -> Any:
    """An argparse type: an integer of at least ``least``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < least:
            raise argparse.ArgumentTypeError(f"expected at least {least}, got {value}")
        return value

    return parse


_positive = _at_least(1)


def _seconds(text: str) -> float:
    """An argparse type: a number of seconds, 0 or more."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected 0 or more seconds, got {text!r}")
    return value


def _rows_bytes(text: str) -> int:
    """An argparse type: a byte count such as 256MiB, of at least one row (4 KiB)."""
    try:
        value = parse_bytes(text)
    except (ValueError, TypeError):
        raise argparse.ArgumentTypeError(f"expected bytes such as 256MiB, got {text!r}") from None
    if value < 4 * _COLS:
        raise argparse.ArgumentTypeError(
            f"expected at least one row of {format_bytes(4 * _COLS)}, got {text!r}"
        )
    return value


def _sub_chunk(text: str) -> str:
    """An argparse type: ``auto`` or a positive byte count, checked before any cluster starts."""
    from .config import check_bytes

    if text != "auto":
        try:
            check_bytes("--sub-chunk", text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(f"expected auto or {e}") from None
    return text


def _setup(args: argparse.Namespace, gpu: bool) -> _DemoSetup:
    """The flags, with the defaults of this machine (larger on a GPU) where they are left out."""
    size = args.size or parse_bytes("4GiB" if gpu else "256MiB")
    chunk = args.chunk or max(size // 16, 1 << 20)
    return _DemoSetup(
        gpu=gpu,
        rows=max(1, size // (4 * _COLS)),
        rows_per_chunk=max(1, chunk // (4 * _COLS)),
        sub_chunk=args.sub_chunk,
        workers=args.workers,
        threads=args.threads,
        rounds=args.rounds,
        keep_open=args.keep_open,
        repeat=args.repeat,
    )


def _dashboard_line(dashboard_link: str, keep_open: float) -> str:
    page = dashboard_link.rsplit("/", 1)[0] + "/overlap"
    stays = (
        f"up while the demo runs and {keep_open:.0f} s after"
        if keep_open > 0
        else "up while the demo runs; --keep-open SECONDS keeps it up after"
    )
    return f"dashboard: {dashboard_link}; the assembly line: {page} ({stays})"


def _make_data(setup: _DemoSetup) -> da.Array:
    """The input, made and kept on the workers, so neither path's time includes making it."""
    import dask.array as da
    from distributed import wait

    x = da.random.default_rng(42).random(
        (setup.rows, _COLS), chunks=(setup.rows_per_chunk, _COLS), dtype=np.float32
    )
    x = x.persist()
    wait(x)
    return x


def _persist_timed(arr: da.Array) -> tuple[da.Array, float]:
    """``arr`` persisted, and the seconds until every chunk of it exists."""
    from distributed import wait

    t0 = time.perf_counter()
    arr = arr.persist()
    wait(arr)
    return arr, time.perf_counter() - t0


def summed_stats(client: Client) -> dict[str, float]:
    """The workers' runtime counters, summed (the numeric ones)."""
    import dask_overlap

    total: dict[str, float] = {}
    for stats in client.run(dask_overlap.runtime_stats).values():
        for key, value in stats.items():
            if isinstance(value, int | float) and not isinstance(value, bool):
                total[key] = total.get(key, 0) + value
    return total


@dataclasses.dataclass(frozen=True)
class _Run:
    """The timed runs: each path's seconds (one a run), dask_overlap's last result, and
    what its runtimes counted over its last timed run alone (the warm-up left out)."""

    naive_runs: tuple[float, ...]
    overlapped: da.Array
    overlap_runs: tuple[float, ...]
    counted: dict[str, float]

    @property
    def naive_seconds(self) -> float:
        return statistics.median(self.naive_runs)

    @property
    def overlap_seconds(self) -> float:
        return statistics.median(self.overlap_runs)

    @property
    def ratio(self) -> float:
        """dask_overlap's throughput over the naive path's, of the medians."""
        return self.naive_seconds / self.overlap_seconds


def _arrays(x: da.Array, setup: _DemoSetup, run: int) -> tuple[da.Array, da.Array]:
    """The naive path's array and dask_overlap's, under keys of run ``run``'s own."""
    import dask.array as da

    import dask_overlap

    kw = setup.kernel_kw
    naive = da.map_blocks(naive_scale_shift, x, token=f"naive-run{run}", **kw)
    overlapped = dask_overlap.map_blocks(
        scale_shift,
        x,
        split_axis=0,
        sub_chunk_bytes=setup.sub_chunk,
        token=f"overlap-run{run}",
        **kw,
    )
    return naive, overlapped


def _run_both(client: Client, x: da.Array, setup: _DemoSetup) -> _Run:
    """Each path ``setup.repeat`` times: its seconds, and dask_overlap's last result
    (persisted) with what its runtimes counted in that run."""
    # Warm-up, the whole array each, one after the other: kernel compilation, the pools
    # and the workers' first touch of fresh memory (the first run of either path pays
    # for page faults that later ones do not) stay out of the times.
    for warm in _arrays(x, setup, 0):
        wait_released(client, _keys(_persist_timed(warm)[0]))
    naive_runs, overlap_runs = [], []
    kept, counted = None, {}
    for run in range(1, setup.repeat + 1):
        naive, overlapped = _arrays(x, setup, run)
        # The paths take turns at going first. Every result is dropped, and the workers
        # have let it go, before the next run starts (so its memory is free for that
        # run, as in one process), but dask_overlap's last, which is checked.
        for path in ("naive", "overlap") if run % 2 else ("overlap", "naive"):
            if path == "naive":
                result, seconds = _persist_timed(naive)
                naive_runs.append(seconds)
            else:
                result, seconds, counted = _counted_run(client, overlapped)
                overlap_runs.append(seconds)
                if run == setup.repeat:
                    kept = result
                    continue
            keys, result = _keys(result), None
            wait_released(client, keys)
        del naive, overlapped
    return _Run(tuple(naive_runs), kept, tuple(overlap_runs), counted)


def _keys(arr: da.Array) -> list:
    from dask.core import flatten

    return list(flatten(arr.__dask_keys__()))


def wait_released(client: Client, keys: list, timeout: float = 10.0) -> None:
    """Wait (at most ``timeout`` seconds) until no worker holds any of ``keys``, whose
    futures the caller has let go.

    The scheduler tells the workers to let a dropped result go a moment after the client
    drops it; a run started before then finds that memory still taken (and dask_overlap's
    result pool empty), where a run in one process finds it free."""
    gc.collect()  # futures held in reference cycles are let go now, not at the next pass
    deadline = time.monotonic() + timeout
    while any(client.run(_held, keys).values()) and time.monotonic() < deadline:
        time.sleep(0.005)


def _held(keys: list, dask_worker: Any = None) -> int:
    """How many of ``keys`` this worker holds (run on the workers by :func:`wait_released`)."""
    return sum(key in dask_worker.data for key in keys)


def _counted_run(client: Client, arr: da.Array) -> tuple[da.Array, float, dict[str, float]]:
    """``arr`` persisted, its seconds, and what the workers' runtimes counted meanwhile."""
    before = summed_stats(client)
    arr, seconds = _persist_timed(arr)
    after = summed_stats(client)
    return arr, seconds, {k: v - before.get(k, 0) for k, v in after.items()}


def _equals_plain_dask(overlapped: da.Array, x: da.Array, setup: _DemoSetup) -> bool:
    import dask.array as da

    reference = da.map_blocks(scale_shift, x, **setup.kernel_kw)
    # On the GPU the kernel may round differently from NumPy's by an ulp.
    rtol = 1e-6 if setup.gpu else 0
    return bool(da.allclose(overlapped, reference, rtol=rtol, atol=0).compute())


def _partitions_line(setup: _DemoSetup, counted: dict[str, float]) -> str:
    """How dask_overlap ran the chunks in the last timed run: as partitions of what size."""
    partitions = int(counted.get("partitions", 0))
    if partitions < 1:
        return "dask_overlap ran no partition in the last timed run"
    size = format_bytes(setup.nbytes // partitions)
    if partitions == setup.chunks:
        how = f"one partition a chunk ({partitions} of {size})"
    else:
        how = (
            f"{partitions} partitions of about {size} (batch='auto' joined small chunks, "
            f"about {setup.chunks / partitions:g} to a partition)"
        )
    sub = (
        setup.sub_chunk or f"overlap.sub-chunk-bytes = {dask.config.get('overlap.sub-chunk-bytes')}"
    )
    return (
        f"dask_overlap ran the {setup.chunks} chunks as {how}, in "
        f"{int(counted.get('sub_chunks', 0))} sub-chunks (sub-chunk size: {sub})"
    )


def _print_report(
    stats: dict[str, dict[str, Any]], setup: _DemoSetup, run: _Run, equal: bool
) -> None:
    """The backend, both throughputs and their ratio, what the last timed run did and the
    check's verdict."""
    backends = sorted({s["backend"] for s in stats.values()})
    print(f"backend: {', '.join(backends)}")
    naive_name = "Dask + CuPy, naive" if setup.gpu else "plain Dask (NumPy)"
    nbytes = setup.nbytes
    runs = f"median of {setup.repeat} runs" if setup.repeat > 1 else "one run"
    print(
        f"throughput, until every chunk exists ({runs}): {naive_name} "
        f"{nbytes / run.naive_seconds / 1e9:.2f} GB/s; dask_overlap "
        f"{nbytes / run.overlap_seconds / 1e9:.2f} GB/s"
    )
    each = ", ".join(f"{n / o:.2f}" for n, o in zip(run.naive_runs, run.overlap_runs, strict=True))
    print(
        f"dask_overlap / {naive_name}: {run.ratio:.2f}x"
        + (f" (run by run: {each})" if setup.repeat > 1 else "")
    )
    if not setup.gpu:
        print(
            "(on the CPU path dask_overlap makes no copy that only a GPU needs, to keep pace "
            "with plain Dask; it cannot beat it: a CPU has nothing to overlap)"
        )
    print(_partitions_line(setup, run.counted))
    c = run.counted
    moved_in, moved_out = (format_bytes(int(c.get(k, 0))) for k in ("bytes_h2d", "bytes_d2h"))
    copies = (
        f"{moved_in} host to device, {moved_out} device to host"
        if setup.gpu
        else f"{moved_in} handed to func as it is, {moved_out} copied into outputs (the CPU "
        "path makes no copy that only a GPU needs: a partition's result is its output)"
    )
    print(
        f"copied in the last timed run (the warm-up left out): {copies}; backpressure "
        f"{c.get('backpressure_seconds', 0):.2f} s (pinned ring full {int(c.get('ring_full', 0))} "
        f"times), pinned fallbacks {int(c.get('pinned_fallbacks', 0))}"
    )
    print(f"result equals plain Dask: {equal}")


def main(argv: list[str] | None = None) -> int:
    """Run the demo; returns the process exit status (0 when the result is right)."""
    args = _parser().parse_args(argv)

    from distributed import Client

    import dask_overlap
    from dask_overlap.backends import gpu_available

    setup = _setup(args, gpu_available())
    print(
        f"dask_overlap demo: {format_bytes(setup.nbytes)} float32 in {setup.chunks} chunks of "
        f"{format_bytes(setup.chunk_bytes)}, on {'the GPU' if setup.gpu else 'the CPU path'}"
    )
    with (
        dask_overlap.LocalGPUCluster(
            n_workers=setup.workers,
            threads_per_worker=setup.threads,
            allow_cpu=True,
        ) as cluster,
        Client(cluster) as client,
    ):
        threads = client.nthreads()
        print(
            f"cluster: {len(threads)} worker(s) x {max(threads.values())} thread(s) "
            "(LocalGPUCluster's defaults unless --workers/--threads)"
        )
        print(_dashboard_line(cluster.dashboard_link, setup.keep_open))
        x = _make_data(setup)
        run = _run_both(client, x, setup)
        equal = _equals_plain_dask(run.overlapped, x, setup)
        stats = client.run(dask_overlap.runtime_stats)
        _print_report(stats, setup, run, equal)
        if setup.keep_open > 0:
            print(f"keeping the cluster up for {setup.keep_open:.0f} s")
            time.sleep(setup.keep_open)
    return 0 if equal else 1


if __name__ == "__main__":
    raise SystemExit(main())
