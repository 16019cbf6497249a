"""Does the way copies are put on streams cost the pinned path its last tenth? (issue 31)

The opt-in pinned path (pinned input, ``out="pinned"``) reached 0.88 of its both-ways
bound on an H100 while the device-to-host engine was busy 0.95 of each run and the
host-to-device engine 0.76: the copies out ran at 31.6 GB/s while they ran, where the
bound's copies move 34 each way. The library puts each sub-chunk's copy in, kernel and
copy out on one stream of its own, so the copies in of several streams share the link
with the copies out, in whatever order the hardware takes them.

This script asks the hardware alone, in plain CuPy (no Dask, no dask_overlap pipeline),
on pinned input and pinned results in sub-chunks of ``--sub-chunk`` bytes, with the
benchmarks' balanced kernel (as long as a sub-chunk's copy in) or none:

- ``per-stream``: every sub-chunk's three steps on one of ``--streams`` streams, as the
  library issues them;
- ``copy-streams``: every copy in on one stream, every copy out on another, the kernels
  on ``--streams`` streams, ordered by events (a hand-written pipeline's layout);

- ``windowed``: as ``per-stream``, but with at most ``--window`` sub-chunks in flight
  (the library's Dask threads times ``in-flight``), this thread waiting for the oldest
  before it issues the next;
- ``windowed-waiter``: the same window, each completion learned as the library learns
  it, on a waiter thread per stream that sleeps in ``cudaEventSynchronize`` and then
  takes the GIL to say so;

each with the kernel and as copies alone, against the bound's copies
(``common.copy_only_seconds``: whole partitions, one stream each way). A layout whose
copies with the kernel reach the copies alone names the cause; if both fall short, it
is not the streams. If ``windowed`` falls short where ``per-stream`` does not, a window of
that depth is too shallow to keep the engines fed; if only ``windowed-waiter`` does, the
hop through a waiter thread costs it.

Then the library's pinned path itself on the same input (``bench_limits.py``'s pinned
row: ``split_axis=0``, ``out="pinned"``, ``--threads`` Dask threads), ``--repeat`` rounds
of a run at each ``in_flight`` of ``--in-flight`` and each Python switch interval of
``--switch-intervals`` in turn, and each of ``--timing`` in turn: ``sampled`` (the
library as it is: a call's first sub-chunks timed on the device, then one every 10 ms,
see ``pipeline/sampling.py``), ``all`` (four timing events around every sub-chunk's
stages, read back once it completed: the library before it sampled cut partitions) or
``off`` (none: the timeline's spans are then estimated). Each run says how long it ran
before its first copy in began on the device (``lead_s``: Dask's and the task's start)
and after its last copy out ended (``tail_s``), from the runtime's timeline.

What it found on an H100 (copy-streams.json): the hardware is not the limit. Each
sub-chunk on its own stream ran at 1.01 of the both-ways bound with the kernel, one copy
stream each way at 0.98; the library's pinned path at 0.92. Copy lanes in the library
(every copy of a direction on one stream, at a1b7949, since reverted) ran at 0.906-0.910
against 0.915-0.927 without, in turn in one call. On another H100 host (bound 36.1-36.7
GB/s), a window of 16 reached 0.94-1.00 of the bound waited on here and 0.93-0.98 through
waiter threads, where the library ran 0.89-0.92 at ``in_flight`` 4 and 8 and at either
switch interval; with its device timing off, 0.882, 0.916 and 0.944 against 0.877, 0.839
and 0.884 with it on, in turn: the lead was the four timing events of every cut
sub-chunk. With them sampled (e688e1a), on an H200, eight rounds in turn over two calls:
sampled 0.862-0.899 of the bound (mean 0.882), every sub-chunk timed 0.802-0.880 (0.854),
none 0.888-0.914 (0.900); sampled beat every sub-chunk timed in seven of eight.

Example (on the GPU)::

    python3 benchmarks/diagnostics/copy_streams.py --size 4GiB --streams 16 8
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import queue
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import dask
import numpy as np

import dask_overlap

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common import (  # noqa: E402
    COLS,
    GB,
    add_output,
    add_repeat,
    array_of_views,
    byte_count,
    comma_list,
    copy_only_seconds,
    device_name,
    fused_kernel,
    make_kernel,
    measure_ceilings,
    parser,
    persist_chunks,
    pinned_copy,
    pinned_pool_size,
    positive,
    random_data,
    rows_of,
    save,
    warm_up,
)

BENCHMARK = "copy-streams"
LAYOUTS = ("per-stream", "copy-streams", "windowed", "windowed-waiter")
TIMINGS = ("sampled", "all", "off")
WINDOWED = ("windowed", "windowed-waiter")


def _subs(host_in: np.ndarray, host_out: np.ndarray, rows: int) -> list[tuple[Any, Any]]:
    return [(host_in[s : s + rows], host_out[s : s + rows]) for s in range(0, len(host_in), rows)]


class _Waiters:
    """A waiter thread per stream, as the library's (``backends/cuda_streams.py``): each
    sleeps in ``cudaEventSynchronize`` on its stream's events in turn and then frees a
    place in the window."""

    def __init__(self, slots: int, window: int):
        import cupy as cp

        self.room = threading.Semaphore(window)
        self._queues: list[queue.SimpleQueue] = [queue.SimpleQueue() for _ in range(slots)]
        device = cp.cuda.runtime.getDevice()
        self._threads = [
            threading.Thread(target=self._loop, args=(q, device), daemon=True) for q in self._queues
        ]
        for t in self._threads:
            t.start()

    def _loop(self, q: queue.SimpleQueue, device: int) -> None:
        import cupy as cp

        cp.cuda.runtime.setDevice(device)
        while (event := q.get()) is not None:
            event.synchronize()
            self.room.release()

    def put(self, j: int, event: Any) -> None:
        self._queues[j].put(event)

    def close(self) -> None:
        for q in self._queues:
            q.put(None)
        for t in self._threads:
            t.join()


def issue(layout: str, subs: list, slots: int, kernel: Callable | None, window: int = 0) -> float:
    """Seconds to run every sub-chunk of ``subs`` (pairs of pinned views, in and out) in
    ``layout`` over ``slots`` device buffers (and as many kernel streams), issued from
    this thread (up front, or ``window`` at most in flight for the windowed layouts);
    ``kernel(x, out)`` between the copies, or none."""
    import cupy as cp

    h2d, d2h = cp.cuda.runtime.memcpyHostToDevice, cp.cuda.runtime.memcpyDeviceToHost
    shape, dtype = subs[0][0].shape, subs[0][0].dtype
    dev_in = [cp.empty(shape, dtype) for _ in range(slots)]
    dev_out = [cp.empty(shape, dtype) for _ in range(slots)]
    streams = [cp.cuda.Stream(non_blocking=True) for _ in range(slots)]
    s_in, s_out = cp.cuda.Stream(non_blocking=True), cp.cuda.Stream(non_blocking=True)
    free: list[Any] = [None] * slots  # the slot's last copy out, done
    waiters = _Waiters(slots, window) if layout == "windowed-waiter" else None
    pending: collections.deque = collections.deque()  # "windowed": oldest first
    cp.cuda.Device().synchronize()
    t0 = time.perf_counter()
    for k, (a, b) in enumerate(subs):
        j = k % slots
        n = a.nbytes
        src = dev_out[j] if kernel is not None else dev_in[j]
        if layout == "per-stream" or layout in WINDOWED:
            if waiters is not None:
                waiters.room.acquire()  # a place in the window
            elif layout == "windowed" and len(pending) >= window:
                pending.popleft().synchronize()
            s = streams[j]  # in order: the slot's last sub-chunk is out before this one
            cp.cuda.runtime.memcpyAsync(dev_in[j].data.ptr, a.ctypes.data, n, h2d, s.ptr)
            if kernel is not None:
                with s:
                    kernel(dev_in[j], dev_out[j])
            cp.cuda.runtime.memcpyAsync(b.ctypes.data, src.data.ptr, n, d2h, s.ptr)
            if layout in WINDOWED:
                done = cp.cuda.Event(block=True, disable_timing=True)
                done.record(s)
                if waiters is not None:
                    waiters.put(j, done)
                else:
                    pending.append(done)
            continue
        if free[j] is not None:
            s_in.wait_event(free[j])
        cp.cuda.runtime.memcpyAsync(dev_in[j].data.ptr, a.ctypes.data, n, h2d, s_in.ptr)
        ready = s_in.record()
        if kernel is not None:
            s = streams[j]
            s.wait_event(ready)  # after the copy in, itself after the slot's copy out
            with s:
                kernel(dev_in[j], dev_out[j])
            ready = s.record()
        s_out.wait_event(ready)
        cp.cuda.runtime.memcpyAsync(b.ctypes.data, src.data.ptr, n, d2h, s_out.ptr)
        free[j] = s_out.record()
    cp.cuda.Device().synchronize()
    seconds = time.perf_counter() - t0
    if waiters is not None:
        waiters.close()
    return seconds


def main(argv: list[str] | None = None) -> dict:
    p = parser(__doc__)
    p.add_argument("--size", type=byte_count, default="4GiB", help="input bytes (float32)")
    p.add_argument("--partition", type=byte_count, default="256MiB", help="the bound's unit")
    p.add_argument("--sub-chunk", type=byte_count, default="32MiB", help="bytes per copy")
    p.add_argument("--streams", type=positive, nargs="+", default=[16, 8], help="device slots")
    p.add_argument("--threads", type=positive, default=4, help="Dask threads of the library")
    p.add_argument(
        "--window",
        type=positive,
        default=16,
        help="sub-chunks in flight in the windowed layouts (the library's threads x in-flight)",
    )
    p.add_argument(
        "--in-flight",
        type=positive,
        nargs="+",
        default=[4],
        help="in_flight of the library's runs, in turn (4: the library's default)",
    )
    p.add_argument(
        "--timing",
        nargs="+",
        choices=TIMINGS,
        default=["sampled"],
        help="device timing of the library's sub-chunks, in turn (sampled: the library's)",
    )
    p.add_argument(
        "--layouts",
        nargs="*",
        choices=LAYOUTS,
        default=list(LAYOUTS),
        help="the plain CuPy layouts to run (none: the library's runs alone)",
    )
    p.add_argument(
        "--switch-intervals",
        type=seconds_list,
        default="0.005,0.0005",
        help="Python switch intervals of the library's runs, in turn (0.005: Python's default)",
    )
    add_repeat(p, 3, "of each layout")
    add_output(p)
    args = p.parse_args(argv)
    rows, part, sub = rows_of(args.size), rows_of(args.partition), rows_of(args.sub_chunk)
    pool = pinned_pool_size(rows * COLS * 4, "pinned", True, "cuda")
    dask.config.set({"overlap.pinned-pool-size": pool})
    try:
        rt = dask_overlap.get_runtime("cuda")
    except ImportError as e:
        raise SystemExit(f"copy_streams.py measures a GPU's copy engines: {e}") from None
    import cupy as cp

    host_in = pinned_copy(rt, random_data((rows, COLS)))
    host_out = pinned_copy(rt, np.zeros_like(host_in))
    ceilings, kernel_s, iterations = measure_ceilings(rt, host_in[:part], "balanced")
    n = np.int32(iterations)

    def kernel(x: Any, out: Any) -> None:  # the balanced kernel, into a slot's buffer
        fused_kernel()(x, n, out)

    nbytes = host_in.nbytes
    whole = copy_only_seconds(host_in, part)
    expect = make_kernel(iterations)(cp.asarray(host_in[:sub])).get()
    subs = _subs(host_in, host_out, sub)
    rows_out: list[dict[str, Any]] = []
    for slots in args.streams:
        for layout in args.layouts:
            for with_kernel in (True, False):
                runs = [
                    issue(layout, subs, slots, kernel if with_kernel else None, args.window)
                    for _ in range(args.repeat)
                ]
                want = expect if with_kernel else host_in[:sub]
                correct = bool(np.array_equal(host_out[:sub], want))
                row = {
                    "layout": layout,
                    "streams": slots,
                    "window": args.window if layout in WINDOWED else None,
                    "kernel": with_kernel,
                    "gbps_each_run": [nbytes / s / GB for s in runs],
                    "gbps": nbytes / min(runs) / GB,
                    "correct": correct,
                }
                rows_out.append(row)
                print(
                    f"  {layout:15s} streams {slots:2d} {'kernel' if with_kernel else 'copies'}: "
                    + ", ".join(f"{g:6.2f}" for g in row["gbps_each_run"])
                    + f" GB/s  correct {correct}",
                    flush=True,
                )
    library = library_runs(args, host_in, part, make_kernel(iterations), expect)
    whole_gbps = nbytes / whole / GB
    for row in library:
        row["ratio_to_whole_copies"] = row["gbps"] / whole_gbps
        row["ratio_to_both_ways"] = row["gbps"] / (ceilings["both"] / 2 / GB)
    for row in rows_out:
        row["ratio_to_whole_copies"] = row["gbps"] / whole_gbps
    both_gbps = ceilings["both"] / 2 / GB
    result = {
        "device": device_name("cuda"),
        "size_bytes": nbytes,
        "partition_bytes": part * COLS * 4,
        "sub_chunk_bytes": sub * COLS * 4,
        "kernel_seconds_per_partition": kernel_s,
        "both_ways_gbps": both_gbps,
        "whole_copies_gbps": whole_gbps,
        "rows": rows_out,
        "library": library,
    }
    print(f"bound (both ways, one partition): {both_gbps:.2f} GB/s; whole copies {whole_gbps:.2f}")
    figures = {
        f"{r['layout']}_{r['streams']}_{'kernel' if r['kernel'] else 'copies'}": round(
            r["ratio_to_whole_copies"], 3
        )
        for r in rows_out
    }
    for in_flight in args.in_flight:
        for interval in args.switch_intervals:
            for timing in args.timing:
                got = [
                    round(r["ratio_to_both_ways"], 3)
                    for r in library
                    if r["switch_interval"] == interval
                    and r["in_flight"] == in_flight
                    and r["device_timing"] == timing
                ]
                name = f"library_in_flight_{in_flight}_switch_{interval:g}_timing_{timing}"
                figures[name] = got
                print(
                    f"library, in_flight {in_flight}, switch interval {interval:g} s, device "
                    f"timing {timing}, of the bound: {got}"
                )
    save(args, BENCHMARK, result, figures, result["device"])
    return result


def library_runs(
    args: argparse.Namespace, host: np.ndarray, part: int, func: Callable, expect: np.ndarray
) -> list[dict[str, Any]]:
    """The pinned path through ``dask_overlap.map_blocks`` after a warm-up, ``args.repeat``
    rounds of a run at each ``in_flight`` of ``args.in_flight``, each of
    ``args.switch_intervals`` (Python's switch interval: how long a thread that wants the
    GIL waits before asking its holder to let go; the runner's completions come back on
    threads of their own) and each device timing of ``args.timing`` (see
    :func:`timing`), in turn: each run's GB/s, whether its first rows are right, and its
    lead and tail."""
    x = array_of_views(host, part)
    threaded = {"scheduler": "threads", "num_workers": args.threads}
    rt = dask_overlap.get_runtime()
    arrays = {}
    for in_flight in args.in_flight:
        arrays[in_flight] = dask_overlap.map_blocks(
            func, x, split_axis=0, dtype=np.float32, out="pinned", in_flight=in_flight
        )
        warm_up(arrays[in_flight], **threaded)
    runs = []
    default = sys.getswitchinterval()
    try:
        for i in range(args.repeat):
            for in_flight, arr in arrays.items():
                for interval in args.switch_intervals:
                    for mode in args.timing:
                        sys.setswitchinterval(interval)
                        got = None  # the last run's results leave the pool first
                        rt.timeline.clear()
                        start = time.time()
                        with timing(mode):
                            seconds, got = persist_chunks(arr, **threaded)
                        row = {
                            "round": i,
                            "in_flight": in_flight,
                            "switch_interval": interval,
                            "device_timing": mode,
                            "gbps": host.nbytes / seconds / GB,
                            "correct": bool(np.array_equal(got[0][: len(expect)], expect)),
                            **lead_and_tail(list(rt.timeline), start, start + seconds),
                        }
                        runs.append(row)
                        print(
                            f"  library, in_flight {in_flight}, switch interval {interval:g} s,"
                            f" device timing {mode:7s}: "
                            f"{row['gbps']:6.2f} GB/s, lead {row['lead_s'] * 1e3:.1f} ms, "
                            f"tail {row['tail_s'] * 1e3:.1f} ms"
                        )
    finally:
        sys.setswitchinterval(default)
    return runs


@contextlib.contextmanager
def timing(mode: str) -> Iterator[None]:
    """While inside, the library's sub-chunks timed on the device as ``mode`` says:
    ``sampled`` (as the library decides), ``all`` or ``off``. Where the backend's marks
    cost nothing it has no sampler, and every sub-chunk is timed whatever ``mode``."""
    from dask_overlap.pipeline.work import PartitionWork

    if mode == "sampled" or dask_overlap.get_runtime().sampler is None:
        yield
        return
    decide = PartitionWork.timed
    PartitionWork.timed = lambda self, i: mode == "all"
    try:
        yield
    finally:
        PartitionWork.timed = decide


def lead_and_tail(spans: list, start: float, end: float) -> dict[str, float]:
    """How long the run ``[start, end]`` went before its first copy in began and after
    its last copy out ended, by the runtime's ``spans`` (``nan`` with none).

    Examples
    --------
    >>> from types import SimpleNamespace as S
    >>> spans = [S(stage="h2d", start=1.5, end=2.0), S(stage="d2h", start=2.0, end=9.0)]
    >>> lead_and_tail(spans, 1.0, 10.0)
    {'lead_s': 0.5, 'tail_s': 1.0}
    """
    ins = [s.start for s in spans if s.stage == "h2d"]
    outs = [s.end for s in spans if s.stage == "d2h"]
    if not ins or not outs:
        return {"lead_s": float("nan"), "tail_s": float("nan")}
    return {"lead_s": min(ins) - start, "tail_s": end - max(outs)}


def seconds_list(text: str) -> list[float]:
    """An argparse type: a comma list of positive seconds.

    Examples
    --------
    >>> seconds_list("0.005,0.0005")
    [0.005, 0.0005]
    """
    try:
        got = comma_list(text, float)
    except ValueError:
        got = []
    if not got or min(got) <= 0:
        raise argparse.ArgumentTypeError(f"expected positive seconds (a comma list), got {text!r}")
    return got


if __name__ == "__main__":
    main()
