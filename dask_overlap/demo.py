"""The demo (the README's main job): a real array through a real cluster, checked.

It starts a :class:`~dask_overlap.LocalGPUCluster` on this machine (one worker per GPU;
on a machine with no GPU, CPU workers on the host backend), makes a float32 array on the
workers, runs the usual Dask + CuPy code (``cp.asnumpy(f(cp.asarray(block)))``) and then
``dask_overlap.map_blocks`` with ``split_axis=0`` and no tuning over it, checks every
element against plain ``dask.array.map_blocks``, and prints both throughputs side by side,
the backend used and the dashboard address. ``python -m dask_overlap demo --help`` lists
the knobs.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from typing import TYPE_CHECKING, Any

import numpy as np
from dask.utils import format_bytes, parse_bytes

if TYPE_CHECKING:
    import dask.array as da

__all__ = ["main", "naive_scale_shift", "scale_shift"]

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
    rows_per_part: int
    sub_chunk: str | None  # None: overlap.sub-chunk-bytes
    workers: int | None
    threads: int
    rounds: int
    keep_open: float

    @property
    def nbytes(self) -> int:
        return self.rows * _COLS * 4

    @property
    def partition_bytes(self) -> int:
        return self.rows_per_part * _COLS * 4

    @property
    def kernel_kw(self) -> dict[str, Any]:
        return {"scale": 2.5, "shift": 1.0, "rounds": self.rounds}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="dask overlap demo",
        description="Run dask_overlap.map_blocks on a local cluster and check it against Dask.",
    )
    p.add_argument("--size", default=None, help="input bytes (default 256MiB; 4GiB on a GPU)")
    p.add_argument("--partition", default=None, help="bytes per partition (default size/16)")
    p.add_argument("--sub-chunk", default=None, help="bytes per sub-chunk (8MiB; 64MiB on a GPU)")
    p.add_argument("--workers", type=int, default=None, help="default: one per GPU, or 2 CPU")
    p.add_argument(
        "--threads", type=int, default=None, help="partitions in flight per worker (2; 4 on a GPU)"
    )
    p.add_argument("--rounds", type=int, default=2, help="kernel length (elementwise passes)")
    p.add_argument(
        "--keep-open",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="keep the cluster (and its dashboard) up this long after the run",
    )
    return p


def _setup(args: argparse.Namespace, gpu: bool) -> _DemoSetup:
    """The flags, with the defaults of this machine (larger on a GPU) where they are left out."""
    size = parse_bytes(args.size or ("4GiB" if gpu else "256MiB"))
    partition = parse_bytes(args.partition) if args.partition else max(size // 16, 1 << 20)
    return _DemoSetup(
        gpu=gpu,
        rows=max(1, size // (4 * _COLS)),
        rows_per_part=max(1, partition // (4 * _COLS)),
        sub_chunk=args.sub_chunk or (None if gpu else "8MiB"),
        workers=args.workers,
        threads=args.threads or (4 if gpu else 2),
        rounds=args.rounds,
        keep_open=args.keep_open,
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
        (setup.rows, _COLS), chunks=(setup.rows_per_part, _COLS), dtype=np.float32
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


def _run_both(x: da.Array, setup: _DemoSetup) -> tuple[float, da.Array, float]:
    """The naive path's seconds, then dask_overlap's result (persisted) and seconds."""
    import dask.array as da
    from distributed import wait

    import dask_overlap

    kw = setup.kernel_kw
    naive = da.map_blocks(naive_scale_shift, x, **kw)
    overlapped = dask_overlap.map_blocks(
        scale_shift, x, split_axis=0, sub_chunk_bytes=setup.sub_chunk, **kw
    )
    # Warm-up on two partitions each: kernel compilation and pools stay out of the times.
    warm = 2 * setup.rows_per_part
    wait([naive[:warm].persist(), overlapped[:warm].persist()])
    # The naive result is dropped at once, so its memory is free before the second run.
    naive_seconds = _persist_timed(naive)[1]
    overlapped, overlap_seconds = _persist_timed(overlapped)
    return naive_seconds, overlapped, overlap_seconds


def _equals_plain_dask(overlapped: da.Array, x: da.Array, setup: _DemoSetup) -> bool:
    import dask.array as da

    reference = da.map_blocks(scale_shift, x, **setup.kernel_kw)
    # On the GPU the kernel may round differently from NumPy's by an ulp.
    rtol = 1e-6 if setup.gpu else 0
    return bool(da.allclose(overlapped, reference, rtol=rtol, atol=0).compute())


def _print_report(
    stats: dict[str, dict[str, Any]],
    setup: _DemoSetup,
    naive_seconds: float,
    overlap_seconds: float,
    equal: bool,
) -> None:
    """The backend, both throughputs, the workers' summed counters and the check's verdict."""
    backends = sorted({s["backend"] for s in stats.values()})
    print(f"backend: {', '.join(backends)} on {len(stats)} worker(s)")
    naive_name = "Dask + CuPy, naive" if setup.gpu else "plain Dask (NumPy)"
    nbytes = setup.nbytes
    print(
        f"throughput, until every chunk exists: {naive_name} "
        f"{nbytes / naive_seconds / 1e9:.2f} GB/s; dask_overlap "
        f"{nbytes / overlap_seconds / 1e9:.2f} GB/s ({naive_seconds / overlap_seconds:.1f}x)"
    )

    def total(counter: str) -> Any:
        return sum(s[counter] for s in stats.values())

    print(
        f"moved: {format_bytes(total('bytes_h2d'))} in, {format_bytes(total('bytes_d2h'))} out, "
        f"{total('sub_chunks')} sub-chunks, backpressure {total('backpressure_seconds'):.2f} s "
        f"(pinned ring full {total('ring_full')} times), "
        f"pinned fallbacks {total('pinned_fallbacks')}"
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
        f"dask_overlap demo: {format_bytes(setup.nbytes)} float32 in partitions of "
        f"{format_bytes(setup.partition_bytes)}, on {'the GPU' if setup.gpu else 'the CPU'}"
    )
    with (
        dask_overlap.LocalGPUCluster(
            n_workers=setup.workers,
            threads_per_worker=setup.threads,
            allow_cpu=True,
        ) as cluster,
        Client(cluster) as client,
    ):
        print(_dashboard_line(cluster.dashboard_link, setup.keep_open))
        x = _make_data(setup)
        naive_seconds, overlapped, overlap_seconds = _run_both(x, setup)
        equal = _equals_plain_dask(overlapped, x, setup)
        stats = client.run(dask_overlap.runtime_stats)
        _print_report(stats, setup, naive_seconds, overlap_seconds, equal)
        if setup.keep_open > 0:
            print(f"keeping the cluster up for {setup.keep_open:.0f} s")
            time.sleep(setup.keep_open)
    return 0 if equal else 1


if __name__ == "__main__":
    raise SystemExit(main())
