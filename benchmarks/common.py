"""What the benchmark scripts share: arguments, data, the kernel, the references, timing,
the stage ceilings, correctness, the device's name and the results files.

Every script under ``benchmarks/`` and ``benchmarks/diagnostics/`` imports this module and
the library, never another script. Timing follows DESIGN.md's "Measuring": after a
warm-up, a timed region ends when every output chunk exists (``persist``, and on a
cluster ``distributed.wait``), never with ``compute()`` to one array; results are
compared element by element with the naive path's.

Results: ``--json PATH`` writes a run's result as it is; ``--record [DIR]`` (default
``benchmarks/results``) writes the benchmark's current file ``DIR/<benchmark>.json`` and
appends one line to ``DIR/history.jsonl`` (see :func:`record`).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import json
import os
import pstats
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Hashable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

import dask
import dask.array as da
import numpy as np
import toolz
from dask.base import tokenize
from dask.core import flatten
from dask.highlevelgraph import HighLevelGraph
from dask.utils import parse_bytes
from distributed import wait

import dask_overlap

T = TypeVar("T")

GB = 1e9
#: float32 columns of the benchmarks' arrays: 4 KiB rows.
COLS = 1024
BACKENDS = ("auto", "cuda", "host", "timed")
WORKLOADS = ("balanced", "transfer", "compute")
#: Kernel time of one partition relative to that partition's H2D copy.
KERNEL_RATIO = {"balanced": 1.0, "transfer": 0.0, "compute": 3.0}
#: The top of benchmarks/: the user-facing scripts; diagnostics/ below it.
BENCHMARKS = Path(__file__).resolve().parent
#: Where the current results and their history live.
RESULTS = BENCHMARKS / "results"
HISTORY_KEYS = ("date", "commit", "device", "benchmark", "figures")


# -- arguments ---------------------------------------------------------------------------


def parser(doc: str | None) -> argparse.ArgumentParser:
    """An argument parser described by the first paragraph of a script's docstring."""
    return argparse.ArgumentParser(description=(doc or "").split("\n\n")[0])


def byte_count(text: str) -> int:
    """An argparse type: a byte count such as ``256MiB`` (``dask.utils.parse_bytes``).

    Examples
    --------
    >>> byte_count("1KiB")
    1024
    """
    try:
        return parse_bytes(text)
    except (ValueError, TypeError) as e:
        raise argparse.ArgumentTypeError(
            f"expected a byte count such as 256MiB, got {text!r}"
        ) from e


def comma_list(text: str | None, parse: Callable[[str], T]) -> list[T]:
    """``"a,b"`` parsed item by item; empty items skipped.

    Examples
    --------
    >>> comma_list("1,,4", int)
    [1, 4]
    """
    return [parse(t) for t in str(text or "").split(",") if t]


def add_backend(
    p: argparse.ArgumentParser, default: str = "auto", choices: Iterable[str] = BACKENDS
) -> None:
    """``--backend``: which dask_overlap backend runs the benchmark."""
    p.add_argument("--backend", default=default, choices=list(choices), help=f"[{default}]")


def positive(text: str) -> int:
    """An argparse type: an integer of at least 1.

    Examples
    --------
    >>> positive("3")
    3
    """
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected an integer of at least 1, got {text!r}")
    return n


def add_repeat(p: argparse.ArgumentParser, default: int, what: str = "of each path") -> None:
    """``--repeat``: timed runs after the warm-up; the best is kept."""
    p.add_argument("--repeat", type=int, default=default, help=f"timed runs {what}; best kept")


def add_output(p: argparse.ArgumentParser) -> None:
    """``--json PATH`` (the result as it is) and ``--record [DIR]`` (see :func:`record`)."""
    p.add_argument("--json", default=None, help="write the result here")
    p.add_argument(
        "--record",
        nargs="?",
        const=str(RESULTS),
        default=None,
        metavar="DIR",
        help="write the current file DIR/<benchmark>.json and append to DIR/history.jsonl "
        "(DIR: benchmarks/results)",
    )


def save(
    args: argparse.Namespace,
    benchmark: str,
    result: Any,
    figures: dict[str, Any],
    device: str,
    case: str | None = None,
) -> None:
    """What :func:`add_output`'s options ask for: ``--json`` writes ``result``; ``--record``
    records it as ``benchmark`` (with ``case``: as that case of the current file, whose
    other cases stay)."""
    write_json(args.json, result)
    if args.record:
        path = Path(args.record) / f"{benchmark}.json"
        if case is None:
            record(benchmark, figures, device, path, result)
        else:
            record(benchmark, {case: figures}, device, path, {case: result}, merge=True)


# -- results -----------------------------------------------------------------------------


def write_json(path: str | os.PathLike | None, data: Any) -> None:
    """Write ``data`` to ``path`` (creating its folder); nothing when ``path`` is None."""
    if path:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            json.dump(data, f, indent=2)


def git_commit() -> str | None:
    """``$OVERLAP_COMMIT`` where set (the GPU machine gets a copy of the working tree whose
    ``.git`` may be stale: pass the commit there), else ``git rev-parse --short HEAD`` of
    this checkout (uncommitted changes not told apart), else ``None``."""
    if os.environ.get("OVERLAP_COMMIT"):
        return os.environ["OVERLAP_COMMIT"]
    try:
        out = subprocess.run(
            ["git", "-C", str(RESULTS.parent), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return None
    return out.stdout.strip() or None


def record(
    benchmark: str,
    figures: dict[str, Any],
    device: str,
    path: str | os.PathLike,
    result: Any = None,
    *,
    merge: bool = False,
    history: str | os.PathLike | None = None,
) -> dict[str, Any]:
    """Write ``benchmark``'s current file at ``path`` and append a line to its history.

    The history (``history``, default ``history.jsonl`` beside ``path``) gets one JSON
    object a line with ``date`` (UTC), ``commit`` (:func:`git_commit`), ``device``,
    ``benchmark`` and ``figures``, the run's headline numbers. The current file holds the
    same keys and ``result``, the run's whole result. With ``merge``, a current file of the
    same benchmark and device keeps its other entries: ``figures`` and ``result`` are dicts
    keyed alike (a case each) and this run's keys replace theirs. (Lines backfilled from
    the files that were there before also say ``source``, ``REV:PATH`` for ``git show``,
    and some a ``note``.)

    Returns the history line.

    Examples
    --------
    >>> import tempfile
    >>> folder = tempfile.mkdtemp()
    >>> line = record("demo", {"gbps": 1.5}, "cpu", f"{folder}/demo.json", {"gbps": 1.5})
    >>> sorted(line) == sorted(HISTORY_KEYS)
    True
    """
    path = Path(path)
    line = {
        "date": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "commit": git_commit(),
        "device": device,
        "benchmark": benchmark,
        "figures": figures,
    }
    current = {**line, "result": result}
    if merge and path.exists():
        old = json.loads(path.read_text())
        if (old.get("benchmark"), old.get("device")) == (benchmark, device):
            current["figures"] = {**old.get("figures", {}), **figures}
            current["result"] = {**(old.get("result") or {}), **(result or {})}
    write_json(path, current)
    history = Path(history) if history is not None else path.parent / "history.jsonl"
    with open(history, "a") as f:
        f.write(json.dumps(line) + "\n")
    return line


def gpu_test_counts(log: str) -> dict[str, int | bool]:
    """Passed, failed, skipped (and errors) of a pytest log, summed over its summary lines
    (a log may hold several runs); a log cut before its summary (``complete`` false)
    counts its progress marks.

    Examples
    --------
    >>> gpu_test_counts("== 1 failed, 9 passed, 2 skipped, 40 deselected in 3.1s ==")
    {'passed': 9, 'failed': 1, 'skipped': 2, 'errors': 0, 'complete': True}
    >>> gpu_test_counts("....  [ 40%]\\n..x.s.X  [ 90%]\\n.")  # cut short; x, X: xfail, xpass
    {'passed': 9, 'failed': 0, 'skipped': 1, 'errors': 0, 'complete': False}
    """
    counts: dict[str, int | bool] = {"passed": 0, "failed": 0, "skipped": 0, "errors": 0}
    lines = [line for line in log.splitlines() if not line.startswith("#")]
    summaries = [
        line
        for line in lines
        if re.search(r"\d+ (passed|failed|skipped|errors?)\b.* in [\d.]+s", line)
    ]
    for line in summaries:
        for n, word in re.findall(r"(\d+) (passed|failed|skipped|errors?)\b", line):
            counts["errors" if word.startswith("error") else word] += int(n)
    if not summaries:  # cut short: count the progress marks ("..s.F... [ 48%]")
        for line in lines:
            marks = re.fullmatch(r"([.sFExX]+)(\s+\[\s*\d+%\])?", line.strip())
            if marks:
                for mark, key in (
                    (".", "passed"),
                    ("s", "skipped"),
                    ("F", "failed"),
                    ("E", "errors"),
                ):
                    counts[key] += marks.group(1).count(mark)
    counts["complete"] = bool(summaries)
    return counts


def run_script(
    script: str | os.PathLike,
    argv: list[str],
    env: dict[str, str] | None = None,
    profile: int = 0,
) -> Any:
    """Run another benchmark script in a process of its own (scripts do not import each
    other) with ``argv``, and return the result it wrote with ``--json``.

    ``env`` is added to this process's environment (``DASK_OVERLAP__...`` settings reach
    the script's ``dask.config``). ``profile`` N: run it under cProfile and print its top N
    functions by own time. Its output goes where this process's goes.
    """
    with tempfile.TemporaryDirectory() as tmp:
        out, prof = Path(tmp) / "result.json", Path(tmp) / "profile"
        cmd = [sys.executable, *(["-m", "cProfile", "-o", str(prof)] if profile else [])]
        sys.stdout.flush()
        subprocess.run(
            [*cmd, str(script), *argv, "--json", str(out)],
            check=True,
            env={**os.environ, **(env or {})},
        )
        if profile:
            pstats.Stats(str(prof)).sort_stats("tottime").print_stats(profile)
        return json.loads(out.read_text())


# -- the device --------------------------------------------------------------------------


def device_name(backend: str = "cuda") -> str:
    """The card a run used, as ``nvidia-smi`` names it (the first visible GPU), or
    ``"cpu"`` for a backend that is not ``cuda``."""
    if backend != "cuda":
        return "cpu"
    cmd = ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"]
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
    if visible:
        cmd += ["-i", visible]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        out = ""
    names = [line.strip() for line in out.splitlines() if line.strip()]
    if names:
        return names[0]
    import cupy  # no nvidia-smi (a container without it): ask CUDA

    name = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)["name"]
    return name.decode() if isinstance(name, bytes) else str(name)


def runtime_device() -> str:
    """:func:`device_name` of this process's runtime (run it on a worker to name its card)."""
    return device_name(dask_overlap.get_runtime().name)


# -- data --------------------------------------------------------------------------------


def rows_of(nbytes: int, row_bytes: int = 4 * COLS) -> int:
    """Whole rows of ``row_bytes`` in ``nbytes``, at least one.

    Examples
    --------
    >>> rows_of(1, 8), rows_of(20, 8)
    (1, 2)
    """
    return max(1, nbytes // row_bytes)


def random_data(shape: tuple[int, ...], threads: int = 16) -> np.ndarray:
    """Float32 random data in ordinary memory, made by several threads (NumPy's
    generators release the GIL); the same data for the same shape."""
    out = np.empty(shape, np.float32)
    bounds = np.linspace(0, shape[0], threads + 1).astype(int)

    def fill(k: int) -> None:
        rng = np.random.default_rng(k)
        rng.random(out=out[bounds[k] : bounds[k + 1]], dtype=np.float32)

    with ThreadPoolExecutor(threads) as ex:
        list(ex.map(fill, range(threads)))
    return out


def array_of_views(host: np.ndarray, rows_per_part: int) -> da.Array:
    """A dask array whose chunks are views of ``host``, ``rows_per_part`` along the first
    axis and whole along the others (``from_array`` would copy them, and a copy of pinned
    input is pageable).

    Examples
    --------
    >>> array_of_views(np.zeros((5, 2, 3)), 2).chunks
    ((2, 2, 1), (2,), (3,))
    """
    name = f"input-{tokenize(host.shape, host.dtype, id(host))}"
    starts = range(0, host.shape[0], rows_per_part)
    rest = (0,) * (host.ndim - 1)
    dsk = {(name, i, *rest): host[s : s + rows_per_part] for i, s in enumerate(starts)}
    rows = tuple(min(rows_per_part, host.shape[0] - s) for s in starts)
    chunks = (rows, *((n,) for n in host.shape[1:]))
    graph = HighLevelGraph.from_collections(name, dsk, dependencies=())
    return da.Array(graph, name, chunks, meta=np.empty((0,) * host.ndim, host.dtype))


def pinned_copy(rt: Any, host: np.ndarray) -> np.ndarray:
    """``host`` copied into pinned memory: page-locked by CUDA on the GPU (outside the
    pool, as a user's pinned data would be), a block of the pool elsewhere."""
    if rt.name == "cuda":
        import cupyx

        pinned = cupyx.empty_pinned(host.shape, host.dtype)
    else:
        block = rt.backend.pinned.allocate(host.nbytes)
        if block is None:
            raise SystemExit("the pinned pool cannot hold the input; raise its size")
        pinned = block.view(host.dtype).reshape(host.shape)
    pinned[...] = host
    return pinned


# -- the kernel --------------------------------------------------------------------------


@functools.cache
def fused_kernel() -> Any:
    """The CuPy ``ElementwiseKernel`` behind :func:`make_kernel` (``(x, n)`` or ``(x, n,
    out)``)."""
    # One fused CuPy kernel whose length is an argument: a Python loop of CuPy operations
    # would measure the host's launch rate, not the GPU. It lives in this importable
    # module, made on first use: a kernel defined in __main__ is copied when Dask pickles
    # the task (dask_overlap/backends/cuda.py, "the __main__ kernel trap").
    import cupy

    return cupy.ElementwiseKernel(
        "float32 x, int32 n",
        "float32 y",
        """
        float v = x * 1.0001f + 0.5f;
        for (int k = 0; k < n; ++k) {
            v = v * 0.9999f + 0.25f;
        }
        y = v;
        """,
        "dask_overlap_bench_kernel",
    )


def make_kernel(iterations: int) -> Callable[[Any], Any]:
    """The benchmarks' kernel: elementwise, with ``iterations`` extra multiply-adds per
    element; a loop of vectorised passes on NumPy, one launch on CuPy.

    Examples
    --------
    >>> make_kernel(0)(np.zeros(2, np.float32)).tolist()
    [0.5, 0.5]
    """

    def kernel(x: Any) -> Any:
        if isinstance(x, np.ndarray):
            y = x * np.float32(1.0001) + np.float32(0.5)
            for _ in range(iterations):
                y = y * np.float32(0.9999) + np.float32(0.25)
            return y
        return fused_kernel()(x, np.int32(iterations))

    kernel.__name__ = f"kernel{iterations}"
    return kernel


# -- the references ----------------------------------------------------------------------


def naive_block(block: np.ndarray, kernel: Callable, backend: str | None = None) -> np.ndarray:
    """One block the usual way, on the runtime's backend: ``cp.asnumpy(f(cp.asarray(b)))``
    on the GPU, its NumPy form on the host backends."""
    return dask_overlap.get_runtime(backend).backend.naive(kernel, block)


def naive(x: da.Array, kernel: Callable, backend: str | None = None) -> da.Array:
    """The naive Dask path: ``x.map_blocks`` of :func:`naive_block` (on a worker, its
    runtime's backend; elsewhere ``backend``, default ``overlap.backend``)."""
    return da.map_blocks(naive_block, x, kernel=kernel, backend=backend, dtype=x.dtype)


_PIECE = 4 << 20


def _pieces(rows: int, row_bytes: int, threads: int) -> list[tuple[int, int]]:
    n = max(1, min(threads, rows * row_bytes // _PIECE, rows))
    bounds = [rows * k // n for k in range(n + 1)]
    return list(zip(bounds, bounds[1:], strict=False))


def run_handwritten(
    host: np.ndarray, rows_per_chunk: int, func: Callable[[Any], Any], in_flight: int, threads: int
) -> tuple[float, list[np.ndarray]]:
    """The hand-written default path, no Dask, no dask_overlap (CUDA only): the anchor.

    Pageable input in, fresh NumPy arrays out, as a user has them. One loop over chunks of
    ``rows_per_chunk`` rows, ``in_flight`` slots, each a pinned input buffer, a pinned
    output buffer and a stream. Per chunk: wait until the slot's last chunk is unstaged;
    ``threads`` threads copy the chunk into the slot's pinned input; on its stream H2D, the
    kernel, D2H into its pinned output, an event; off the loop, a waiter thread waits for
    the event and the same threads copy the output into a fresh ``np.empty`` chunk. So
    staging chunk i+1 overlaps the GPU work of chunk i and the unstaging of chunk i-1.

    Returns the seconds until every output chunk exists, and the chunks.
    """
    import cupy as cp
    import cupyx

    shape = (rows_per_chunk, *host.shape[1:])
    row_bytes = host[:1].nbytes
    slots = [
        {
            "pin_in": cupyx.empty_pinned(shape, host.dtype),
            "pin_out": cupyx.empty_pinned(shape, host.dtype),
            "dev": cp.empty(shape, host.dtype),
            "stream": cp.cuda.Stream(non_blocking=True),
            "done": None,  # futures of the slot's last unstaging
        }
        for _ in range(in_flight)
    ]
    copies = ThreadPoolExecutor(threads)
    waiter = ThreadPoolExecutor(1)
    outputs: list[np.ndarray] = []

    def unstage(event: Any, src: np.ndarray, dst: np.ndarray) -> list[Future]:
        event.synchronize()
        return [
            copies.submit(np.copyto, dst[lo:hi], src[lo:hi])
            for lo, hi in _pieces(len(src), row_bytes, threads)
        ]

    start = time.perf_counter()
    for c, lo in enumerate(range(0, host.shape[0], rows_per_chunk)):
        hi = min(lo + rows_per_chunk, host.shape[0])
        slot = slots[c % in_flight]
        if slot["done"] is not None:
            wait_futures(slot["done"].result())
        src = host[lo:hi]
        pin_in, pin_out = slot["pin_in"][: hi - lo], slot["pin_out"][: hi - lo]
        wait_futures(
            [
                copies.submit(np.copyto, pin_in[a:b], src[a:b])
                for a, b in _pieces(hi - lo, row_bytes, threads)
            ]
        )
        stream = slot["stream"]
        with stream:
            dev = slot["dev"][: hi - lo]
            dev.set(pin_in, stream=stream)
            out = func(dev)
            out.get(stream=stream, out=pin_out, blocking=False)
            event = stream.record()
        result = np.empty(pin_out.shape, pin_out.dtype)
        outputs.append(result)
        slot["done"] = waiter.submit(unstage, event, pin_out, result)
    for slot in slots:
        if slot["done"] is not None:
            wait_futures(slot["done"].result())
    seconds = time.perf_counter() - start
    copies.shutdown()
    waiter.shutdown()
    return seconds, outputs


def handwritten_runs(
    host: np.ndarray,
    func: Callable[[Any], Any],
    want: list[np.ndarray],
    in_flights: Iterable[int],
    threads: Iterable[int],
    repeat: int,
    chunk_bytes: int = 64 << 20,
) -> list[dict[str, Any]]:
    """:func:`run_handwritten` over chunks of about ``chunk_bytes``, for every pair of
    ``in_flights`` and ``threads``, each the best of ``repeat``: one dict a pair
    (``in_flight``, ``threads``, ``gbps`` of input, ``ok``: its chunks equal ``want``'s)."""
    rows_per_chunk = max(1, chunk_bytes // host[:1].nbytes)
    out = []
    for k in in_flights:
        for t in threads:
            best, chunks = best_of(
                lambda k=k, t=t: run_handwritten(host, rows_per_chunk, func, k, t), repeat
            )
            ok = same_chunks(want, chunks)
            del chunks
            out.append({"in_flight": k, "threads": t, "gbps": host.nbytes / best / GB, "ok": ok})
            print(
                f"  hand-written, {k} in flight, {t} threads: {out[-1]['gbps']:7.2f} GB/s"
                + ("" if ok else "  WRONG"),
                flush=True,
            )
    return out


def gaussian_rows(block: Any) -> Any:
    """``gaussian_filter1d`` along rows (sigma 8), on CuPy or NumPy blocks alike: a real
    library kernel, row-independent."""
    if isinstance(block, np.ndarray):
        from scipy.ndimage import gaussian_filter1d
    else:
        from cupyx.scipy.ndimage import gaussian_filter1d
    return gaussian_filter1d(block, sigma=8.0, axis=-1)


def gaussian_volume(block: Any) -> Any:
    """A 3-D ``gaussian_filter`` (sigma 2, boundary ``reflect``) of a block, on CuPy or
    NumPy alike: every output point reads its neighbours along every axis."""
    if isinstance(block, np.ndarray):
        from scipy.ndimage import gaussian_filter
    else:
        from cupyx.scipy.ndimage import gaussian_filter
    return gaussian_filter(block, 2.0)


def gaussian_case(nbytes: int, rows_per_part: int, repeat: int = 2) -> dict[str, Any]:
    """:func:`gaussian_rows` over ``nbytes`` of pageable float32 in partitions of
    ``rows_per_part`` rows: naive Dask + CuPy against ``dask_overlap.map_blocks`` with
    defaults (``split_axis=0``, and no split), each warmed up just before it is timed;
    both compared element by element with the naive path's chunks."""
    host = random_data((max(1, nbytes // (4 * COLS)), COLS))
    x = array_of_views(host, rows_per_part)
    naive_s, ref = warm_then_time(naive(x, gaussian_rows), 1)
    ours = dask_overlap.map_blocks(gaussian_rows, x, split_axis=0, dtype=np.float32)
    ours_s, got = warm_then_time(ours, repeat)
    correct = same_chunks(ref, got)
    del got
    whole_s, got = warm_then_time(
        dask_overlap.map_blocks(gaussian_rows, x, dtype=np.float32), repeat
    )
    correct = correct and same_chunks(ref, got)
    out = {
        "size_bytes": host.nbytes,
        "naive_gbps": host.nbytes / naive_s / GB,
        "default_gbps": host.nbytes / ours_s / GB,
        "nosplit_gbps": host.nbytes / whole_s / GB,
        "speedup_vs_naive": naive_s / ours_s,
        "correct": bool(correct),
    }
    print(
        f"  gaussian_filter1d along rows, {host.nbytes / 2**20:.0f} MiB: naive "
        f"{out['naive_gbps']:.2f} GB/s, dask_overlap {out['default_gbps']:.2f} GB/s "
        f"(no split {out['nosplit_gbps']:.2f}), {out['speedup_vs_naive']:.2f}x, "
        f"correct={out['correct']}",
        flush=True,
    )
    return out


# -- timing and correctness --------------------------------------------------------------


class GcPauses:
    """The cyclic garbage collector's passes while it is on (a context manager): how many
    of each generation and the seconds they held the GIL. A pass stops every Python
    thread, the ones that feed the GPU included; a slow run with as much more CPU time
    as wall time points here.

    Examples
    --------
    >>> with GcPauses() as pauses:
    ...     _ = gc.collect()
    >>> pauses.summary()["passes"][2]
    1
    """

    def __init__(self) -> None:
        self.passes = [0, 0, 0]
        self.seconds = 0.0
        self._start = 0.0

    def _callback(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.passes[info["generation"]] += 1
            self.seconds += time.perf_counter() - self._start

    def __enter__(self) -> GcPauses:
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc: Any) -> None:
        gc.callbacks.remove(self._callback)

    def summary(self) -> dict[str, Any]:
        return {"passes": list(self.passes), "ms": self.seconds * 1e3}


def thread_cpu() -> dict[int, tuple[str, float]]:
    """CPU seconds (user and system) each thread of this process has used so far, by its
    kernel id, with its Python name stripped of trailing numbers (the copy threads under
    one name, the threaded scheduler's under another); threads Python did not start (the
    CUDA driver's, say) are ``"native"``. Empty where ``/proc`` has no threads (not Linux).

    Examples
    --------
    >>> names = {name for name, _ in thread_cpu().values()}
    >>> "MainThread" in names or not names
    True
    """
    out: dict[int, tuple[str, float]] = {}
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        return out
    names = {t.native_id: t.name for t in threading.enumerate() if t.native_id is not None}
    tick = os.sysconf("SC_CLK_TCK")  # (there is a /proc: Linux)
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:  # ended since the listing
            continue
        name = re.sub(r"([-_]\d+)+$", "", names.get(tid, "native"))
        out[tid] = (name, (int(fields[11]) + int(fields[12])) / tick)  # utime, stime
    return out


def thread_cpu_since(before: dict[int, tuple[str, float]]) -> dict[str, float]:
    """CPU seconds used since ``before`` (a :func:`thread_cpu`), summed by thread name,
    most first: which threads a slow run's extra CPU time went to. A thread that ended in
    between is not counted (the pools' threads live as long as their runtime)."""
    spent: dict[str, float] = {}
    for tid, (name, seconds) in thread_cpu().items():
        spent[name] = spent.get(name, 0.0) + seconds - before.get(tid, (name, 0.0))[1]
    return dict(sorted(((k, v) for k, v in spent.items() if v > 0), key=lambda kv: -kv[1]))


def rss() -> int:
    """This process's resident bytes (Linux)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def persist_timed(arr: da.Array, client: Any = None, **persist_kw: Any) -> tuple[float, Any]:
    """Seconds until every chunk of ``arr`` exists, and the persisted array: ``dask.persist``
    (``persist_kw``: its scheduler), or on ``client`` ``persist`` and ``distributed.wait``."""
    t0 = time.perf_counter()
    if client is None:
        (done,) = dask.persist(arr, **persist_kw)
    else:
        done = client.persist(arr, **persist_kw)
        wait(done)
    return time.perf_counter() - t0, done


def _computes_here(keys: list, dask_worker: Any = None) -> list[tuple[float, float, int]]:
    """(On the worker) each of ``keys``' compute: its start and stop on this machine's
    ``time.time()`` and the thread that ran it. (The worker records them on the
    scheduler's clock, as it estimates it: its ``scheduler_delay`` is taken off.)"""
    out, delay = [], dask_worker.scheduler_delay
    for key in keys:
        ts = dask_worker.state.tasks.get(key)
        for ss in ts.startstops if ts is not None else ():
            if ss["action"] == "compute":
                thread = dask_worker.threads.get(key, 0)
                out.append((ss["start"] - delay, ss["stop"] - delay, thread))
    return out


def phases(submitted: float, done: float, computes: list[tuple[float, float, Hashable]]) -> dict:
    """Where a cluster run's seconds went, from ``submitted`` (the client's ``persist``)
    to ``done`` (its ``wait`` returned) and the workers' ``computes`` (start, stop, and
    the thread: anything that names one), all on one clock: ``lead`` until the first
    task started, ``span`` from then until the last stopped, ``tail`` from then until the
    client knew; ``hop_mean`` and ``hop_max``, a thread's idle time between one of its
    tasks and its next; ``busy``, the compute time of the threads that ran tasks over
    their span. Milliseconds, but ``busy``.

    Examples
    --------
    >>> p = phases(0.0, 1.0, [(0.1, 0.5, 1), (0.52, 0.9, 1), (0.1, 0.8, 2)])
    >>> {k: round(v, 3) for k, v in p.items()}  # doctest: +NORMALIZE_WHITESPACE
    {'lead_ms': 100.0, 'span_ms': 800.0, 'tail_ms': 100.0, 'hop_mean_ms': 20.0,
     'hop_max_ms': 20.0, 'busy': 0.925}
    >>> phases(0.0, 1.0, [])  # no record found: nothing to split (the run is not lost)
    {}
    >>> phases(0.0, 1.0, [(0.5, 0.5, 1)])["busy"]  # no span: no fraction to take of it
    0.0
    """
    if not computes:
        return {}
    first, last = min(c[0] for c in computes), max(c[1] for c in computes)
    by_thread: dict[Hashable, list[tuple[float, float]]] = {}
    for start, stop, thread in computes:
        by_thread.setdefault(thread, []).append((start, stop))
    hops = []
    for runs in by_thread.values():
        runs.sort()
        hops += [b[0] - a[1] for a, b in zip(runs, runs[1:], strict=False)]
    work = sum(stop - start for start, stop, _ in computes)
    return {
        "lead_ms": 1e3 * (first - submitted),
        "span_ms": 1e3 * (last - first),
        "tail_ms": 1e3 * (done - last),
        "hop_mean_ms": 1e3 * sum(hops) / len(hops) if hops else 0.0,
        "hop_max_ms": 1e3 * max(hops, default=0.0),
        "busy": work / (len(by_thread) * (last - first)) if last > first else 0.0,
    }


def worker_computes(client: Any, keys: list) -> list[tuple[float, float, Hashable]]:
    """Each of ``keys``' compute on the workers of ``client`` (start, stop, thread) for
    :func:`phases`, on this machine's clock, a thread named by its worker and its id
    there (two workers' thread ids can coincide)."""
    return [
        (start, stop, (worker, thread))
        for worker, cs in client.run(_computes_here, keys).items()
        for start, stop, thread in cs
    ]


def persist_phased(arr: da.Array, client: Any) -> tuple[float, Any, dict]:
    """:func:`persist_timed` on ``client``, and where the run's seconds went
    (:func:`phases`, with ``computes``: how many compute records the workers had), read
    from the workers after the timed run."""
    submitted = time.time()
    seconds, done = persist_timed(arr, client)
    finished = time.time()
    computes = worker_computes(client, keys_of(done))
    return seconds, done, {"computes": len(computes), **phases(submitted, finished, computes)}


# -- the demo's partitions (bench_limits.py's demo row, diagnostics/demo_gap.py) ----------

#: The demo's kernel (dask_overlap/demo.py: scale_shift with its default rounds).
DEMO_KERNEL = {"scale": 2.5, "shift": 1.0, "rounds": 2}


def demo_input(rows: int, rows_per_part: int) -> da.Array:
    """The demo's input: the same values wherever it is made."""
    return da.random.default_rng(42).random(
        (rows, COLS), chunks=(rows_per_part, COLS), dtype=np.float32
    )


def noop_seconds(
    x: da.Array, repeat: int, tag: str, client: Any = None, **persist_kw: Any
) -> float:
    """The best of ``repeat`` persists (on ``client``, else ``persist_kw``'s scheduler) of
    a task a block of ``x`` that returns its block: what the scheduler costs a call on
    those blocks, with no work in the tasks. Each run has keys of its own (``tag``), so
    that none finds its results in memory already."""
    best = float("inf")
    for i in range(repeat):
        same = da.map_blocks(toolz.identity, x, dtype=x.dtype, name=f"noop-{tag}-{i}")
        seconds, done = persist_timed(same, client, **persist_kw)
        best = min(best, seconds)
        del done
    return best


def equals_plain_dask(done: da.Array, x: da.Array, gpu: bool) -> bool:
    """The demo's check: ``done`` against ``dask.array.map_blocks`` of its kernel on NumPy
    blocks (on the GPU, to an ulp: CuPy may round differently)."""
    from dask_overlap.demo import scale_shift

    reference = da.map_blocks(scale_shift, x, **DEMO_KERNEL)
    return bool(da.allclose(done, reference, rtol=1e-6 if gpu else 0, atol=0).compute())


def demo_reference(backend: str, rows: int, rows_per_part: int) -> tuple[da.Array, da.Array]:
    """The demo's partitions on the default path in this process (threaded scheduler, no
    ``overlap.*`` setting), warmed up: the array to persist, and its input (persisted)."""
    from dask_overlap.demo import scale_shift

    dask_overlap.get_runtime(backend)
    (x,) = dask.persist(demo_input(rows, rows_per_part), scheduler="threads")
    arr = dask_overlap.map_blocks(scale_shift, x, split_axis=0, **DEMO_KERNEL)
    warm_up(arr, scheduler="threads")
    return arr, x


def demo_threaded(backend: str, repeat: int, rows: int, rows_per_part: int) -> tuple[float, bool]:
    """:func:`demo_reference`'s best of ``repeat`` runs: GB/s and the check."""
    rt = dask_overlap.get_runtime(backend)
    arr, x = demo_reference(backend, rows, rows_per_part)
    seconds, done = float("inf"), None
    for _ in range(repeat):
        done = None  # the last run's result goes before the next run
        s, done = persist_timed(arr, scheduler="threads")
        seconds = min(seconds, s)
    return rows * COLS * 4 / seconds / GB, equals_plain_dask(done, x, rt.name == "cuda")


def keys_of(arr: da.Array) -> list:
    """The keys of ``arr``'s chunks, in block order."""
    return list(flatten(arr.__dask_keys__()))


def persist_chunks(arr: da.Array, **persist_kw: Any) -> tuple[float, list[np.ndarray]]:
    """:func:`persist_timed` on a local scheduler, and the chunks (in block order)."""
    seconds, done = persist_timed(arr, **persist_kw)
    graph = done.__dask_graph__()
    return seconds, [np.asarray(graph[k]) for k in keys_of(done)]


def best_of(run: Callable[[], tuple[float, T]], repeat: int) -> tuple[float, T]:
    """The best seconds of ``repeat`` calls of ``run`` (each returns seconds and a value)
    and the last call's value; each value is let go before the next call."""
    best, value = float("inf"), None
    for _ in range(repeat):
        value = None  # the last run's chunks go before the next run
        seconds, value = run()
        best = min(best, seconds)
    return best, value


def best_persist(arr: da.Array, repeat: int, **persist_kw: Any) -> tuple[float, list]:
    """The best of ``repeat`` :func:`persist_chunks`, and the last run's chunks."""
    return best_of(lambda: persist_chunks(arr, **persist_kw), repeat)


def turns(names: Iterable[str], repeat: int) -> list[tuple[int, str]]:
    """(round, name) for ``repeat`` rounds of ``names`` in turn, every other round in the
    reverse order, so that neither is always the one that follows the other: a place in
    the turn that costs (the memory the run before let go, a pool it left) weighs on each
    alike, as a drift of the machine's speed does.

    >>> turns(["a", "b"], 3)
    [(0, 'a'), (0, 'b'), (1, 'b'), (1, 'a'), (2, 'a'), (2, 'b')]
    """
    order = list(names)
    return [(i, name) for i in range(repeat) for name in (order[::-1] if i % 2 else order)]


def persist_in_turn(
    arrays: dict[str, da.Array],
    repeat: int,
    check: Callable[[list[np.ndarray]], bool],
    **persist_kw: Any,
) -> tuple[dict[str, list[float]], dict[str, bool]]:
    """Each of ``arrays`` persisted once in turn, ``repeat`` times over: the seconds of each
    one's runs, and whether ``check`` held for every run's chunks. A drift of the machine's
    speed weighs on each alike, and the i-th runs make a pair (:func:`pair_ratios`); every
    other round runs them in the reverse order (:func:`turns`)."""
    seconds: dict[str, list[float]] = {name: [] for name in arrays}
    ok = dict.fromkeys(arrays, True)
    for _, name in turns(arrays, repeat):
        s, got = persist_chunks(arrays[name], **persist_kw)
        seconds[name].append(s)
        ok[name] = ok[name] and check(got)
        del got  # the run's chunks go before the next run
    return seconds, ok


def pair_ratios(seconds: list[float], other: list[float]) -> dict[str, Any]:
    """How fast the runs of ``seconds`` were against those of ``other``: ``best`` over
    best, each pair's (``pairs``) and their ``median``.

    >>> pair_ratios([1.0, 2.0, 1.0], [2.0, 2.0, 1.5])
    {'best': 1.5, 'pairs': [2.0, 1.0, 1.5], 'median': 1.5}
    """
    pairs = [o / s for s, o in zip(seconds, other, strict=True)]
    return {"best": min(other) / min(seconds), "pairs": pairs, "median": statistics.median(pairs)}


def warm_up(*arrays: da.Array, blocks: int = 2, **persist_kw: Any) -> None:
    """Persist the first ``blocks`` row blocks of each array, one after the other:
    compilation, pool creation and first touch stay out of the numbers."""
    for arr in arrays:
        dask.persist(arr[: blocks * arr.chunks[0][0]], **persist_kw)


def warm_then_time(arr: da.Array, repeat: int, **persist_kw: Any) -> tuple[float, list]:
    """:func:`warm_up` of ``arr`` just before :func:`best_persist` of it: a case's own
    compilation, pools and first touch stay out of its figure, and no other case runs in
    between."""
    warm_up(arr, **persist_kw)
    return best_persist(arr, repeat, **persist_kw)


def same_chunks(a: list[np.ndarray], b: list[np.ndarray]) -> bool:
    """Element-by-element equality of two lists of row blocks, whatever their cuts (a
    batch's blocks are several of the naive path's), without joining either.

    Examples
    --------
    >>> x = np.arange(6).reshape(6, 1)
    >>> same_chunks([x[:2], x[2:]], [x[:3], x[3:]])
    True
    """
    i = j = at_a = at_b = 0
    while i < len(a) and j < len(b):
        n = min(len(a[i]) - at_a, len(b[j]) - at_b)
        if not np.array_equal(a[i][at_a : at_a + n], b[j][at_b : at_b + n]):
            return False
        at_a, at_b = at_a + n, at_b + n
        if at_a == len(a[i]):
            i, at_a = i + 1, 0
        if at_b == len(b[j]):
            j, at_b = j + 1, 0
    return all(len(x) == 0 for x in a[i:]) and all(len(y) == 0 for y in b[j:])


def engine_busy(spans: Iterable, start: float, end: float) -> dict[str, float]:
    """Per stage, the fraction of ``[start, end]`` covered by at least one of its spans.

    A stream's span starts when the stream reaches it, which may be before its engine
    takes it up, so this is an upper bound on each engine's busy time: where it is low,
    that engine sat idle for certain.
    """
    spans = list(spans)
    out = {}
    for stage in sorted({s.stage for s in spans}):
        covered, reach = 0.0, start
        for s in sorted((s for s in spans if s.stage == stage), key=lambda s: s.start):
            lo, hi = max(s.start, reach), min(s.end, end)
            if hi > lo:
                covered += hi - lo
            reach = max(reach, s.end)
        out[stage] = covered / (end - start) if end > start else 0.0
    return out


#: What :func:`counted` reads of a runtime's ``stats()``: partitions and sub-chunks (a
#: partition cut by ``sub-chunk-bytes: auto`` runs more than one), the seconds its tasks
#: waited on the window, the pinned ring full and waited on, blocks that fell back to
#: pageable copies (and of those, the ones the pinned allocator refused although its
#: budget had room: a fragmented pool), results made in reused and in fresh memory.
COUNTED = (
    "partitions",
    "sub_chunks",
    "backpressure_seconds",
    "ring_full",
    "ring_waits",
    "pinned_fallbacks",
    "pinned_refused",
    "results_reused",
    "results_fresh",
)


def counted(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """What a runtime counted between two of its ``stats()``: :data:`COUNTED` and each
    stage's busy seconds.

    Examples
    --------
    >>> a = dict.fromkeys(COUNTED, 0) | {"busy_seconds": {"h2d": 1.0}}
    >>> b = dict.fromkeys(COUNTED, 2) | {"busy_seconds": {"h2d": 1.5, "d2h": 0.5}}
    >>> c = counted(a, b)
    >>> c["partitions"], c["busy_seconds"]
    (2, {'h2d': 0.5, 'd2h': 0.5})
    """
    out: dict[str, Any] = {k: after[k] - before[k] for k in COUNTED}
    busy0 = before["busy_seconds"]
    out["busy_seconds"] = {k: v - busy0.get(k, 0.0) for k, v in after["busy_seconds"].items()}
    return out


# -- the bound ---------------------------------------------------------------------------


def bound_seconds(
    total_in: int,
    total_out: int,
    kernel_s: float,
    ceilings: dict,
    staged: bool,
    unstaged: bool = False,
) -> tuple[float, str, dict[str, float]]:
    """The slowest stage: each stage's bytes over its rate; ``stage`` names the winner.

    Staging in and unstaging out are host copies on the same threads: they count as one
    stage, the input at the staging rate, the results at the rate of copies into fresh
    memory (``fresh``), since every result is a new array.
    """
    stages = {
        "h2d": total_in / ceilings["h2d"],
        "d2h": total_out / ceilings["d2h"],
        "kernel": kernel_s,
    }
    if ceilings.get("both"):
        stages["both_ways"] = (total_in + total_out) / ceilings["both"]
    if (staged or unstaged) and ceilings.get("staging"):
        stages["host_copies"] = total_in * staged / ceilings["staging"] + total_out * unstaged / (
            ceilings.get("fresh") or ceilings["staging"]
        )
    if ceilings.get("host_cores"):
        # The host backend has no separate engines: every stage runs on the same cores.
        stages["host_cpu"] = sum(stages.values()) / ceilings["host_cores"]
    name = max(stages, key=stages.get)
    return stages[name], name, stages


def pinned_pool_size(nbytes: int, out: str, pinned_input: bool, backend: str) -> int:
    """``overlap.pinned-pool-size`` for a run of ``nbytes`` of input whose results stay in
    the pool (``out="pinned"``) or whose input is the pool's (pinned input off the GPU,
    where only the pool's blocks count as pinned): those kept blocks may take half the
    pool, the ring has the rest; never below the configured size.

    Examples
    --------
    >>> pinned_pool_size(10 * 2**30, "pinned", False, "cuda") / 2**30  # 2.1 x 10 + 1
    22.0
    """
    kept = nbytes * ((out == "pinned") + (pinned_input and backend != "cuda"))
    configured = parse_bytes(str(dask.config.get("overlap.pinned-pool-size")))
    return max(int(2.1 * kept) + 2**30, configured)


# -- stage ceilings ----------------------------------------------------------------------

#: Host copy rates are measured on at least this many bytes: the rate of the many copies
#: a run makes, not one small copy's hand-off latency.
PROBE_BYTES = 64 << 20


def _best(fn: Callable[[], Any], repeat: int = 3) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _iterations(one_pass: float, base: float, target: float) -> int:
    """Iterations of the kernel loop so that ``base + n * one_pass`` is about ``target``."""
    if target <= base or one_pass <= 0:
        return 0
    return max(0, round((target - base) / one_pass))


def parallel_copy_rate(
    src: np.ndarray, dst: np.ndarray | None, threads: int, repeat: int = 3
) -> float:
    """Bytes per second of ``threads`` threads copying ``src`` into ``dst`` in slices
    (the best of ``repeat``). ``dst`` ``None``: into a new array each time, whose pages
    the copy faults in, as it does a partition's fresh result."""
    parts = np.array_split(np.arange(src.shape[0]), threads)
    best = float("inf")
    with ThreadPoolExecutor(threads) as ex:
        for _ in range(repeat):
            out = np.empty_like(src) if dst is None else dst

            def copy(idx: np.ndarray, out: np.ndarray = out) -> None:
                if len(idx):
                    np.copyto(out[idx[0] : idx[-1] + 1], src[idx[0] : idx[-1] + 1])

            t0 = time.perf_counter()
            list(ex.map(copy, parts))
            best = min(best, time.perf_counter() - t0)
            del out
    return src.nbytes / best


def _host_rates(pinned: np.ndarray, threads: int) -> dict[str, float]:
    """``staging`` (pageable into the ring) and ``fresh`` (the ring into a new result)
    rates, on ``pinned``, a ring block of at least :data:`PROBE_BYTES`."""
    flat = pinned.view(np.uint8)
    pageable = np.ones_like(flat)
    return {
        "staging": parallel_copy_rate(pageable, flat, threads),
        "fresh": parallel_copy_rate(flat, None, threads),
    }


def _timed_ceilings(rt: Any, block: np.ndarray) -> tuple[dict, float, int]:
    m = rt.backend.model
    ceilings = {
        "h2d": m.h2d_bandwidth,
        "d2h": m.d2h_bandwidth,
        "staging": m.staging_bandwidth * rt.copy_threads,
    }
    return ceilings, m.kernel_time(block.nbytes), 0


def _host_ceilings(rt: Any, block: np.ndarray, ratio: float) -> tuple[dict, float, int]:
    dst = np.empty_like(block)
    copy = block.nbytes / _best(lambda: np.copyto(dst, block))
    ceilings = {"h2d": copy, "d2h": copy, "host_cores": float(os.cpu_count() or 1)}
    ceilings.update(_host_rates(np.empty(max(block.nbytes, PROBE_BYTES), np.uint8), 1))
    base = _best(lambda: make_kernel(0)(block))
    # A probe of several passes, as on the GPU: one pass's cost taken as the difference of
    # two noisy bests could come out at twice its size and halve the iterations.
    probe = 8
    one = (_best(lambda: make_kernel(probe)(block)) - base) / probe
    iterations = _iterations(one, base, ratio * block.nbytes / copy)
    return ceilings, _best(lambda: make_kernel(iterations)(block)), iterations


def _cuda_ceilings(rt: Any, block: np.ndarray, ratio: float) -> tuple[dict, float, int]:
    import cupy as cp

    pool = rt.backend.pinned
    n = block.nbytes
    pin_in = pool.allocate(n)
    pin_out = pool.allocate(n)
    if pin_in is None or pin_out is None:
        raise RuntimeError("the pinned pool cannot hold two partitions for the ceilings")
    pin_in = pin_in.view(block.dtype).reshape(block.shape)
    pin_out = pin_out.view(block.dtype).reshape(block.shape)
    pin_in[...] = block
    dev_a = cp.empty(block.shape, block.dtype)
    dev_b = cp.empty(block.shape, block.dtype)
    s1 = cp.cuda.Stream(non_blocking=True)
    s2 = cp.cuda.Stream(non_blocking=True)

    def timed(fn: Callable[[], None]) -> float:
        best = float("inf")
        for _ in range(5):
            cp.cuda.Device().synchronize()
            t0 = time.perf_counter()
            fn()
            cp.cuda.Device().synchronize()
            best = min(best, time.perf_counter() - t0)
        return best

    h2d = n / timed(lambda: dev_a.set(pin_in, stream=s1))
    d2h = n / timed(lambda: dev_b.get(stream=s2, out=pin_out, blocking=False))

    def both() -> None:
        dev_a.set(pin_in, stream=s1)
        dev_b.get(stream=s2, out=pin_out, blocking=False)

    both_rate = 2 * n / timed(both)
    probe = pool.allocate(max(n, PROBE_BYTES))
    if probe is None:
        raise RuntimeError("the pinned pool cannot hold the host copies' probe")
    host = _host_rates(probe, rt.copy_threads)
    del probe

    def kernel_seconds(iterations: int) -> float:
        k = make_kernel(iterations)
        k(dev_a)  # compile
        return timed(lambda: k(dev_a))

    # The fused kernel's cost per iteration is small (one multiply-add per element):
    # probe with enough iterations to rise clear of the memory-bound base time.
    base = kernel_seconds(0)
    probe_iterations = 1024
    one = (kernel_seconds(probe_iterations) - base) / probe_iterations
    iterations = _iterations(one, base, ratio * n / h2d)
    ceilings = {"h2d": h2d, "d2h": d2h, "both": both_rate, **host}
    return ceilings, kernel_seconds(iterations), iterations


def copy_only_seconds(host: np.ndarray, rows_per_part: int, repeat: int = 3) -> float | None:
    """The best of ``repeat`` runs of copies alone over all of ``host`` (pinned), a
    partition of ``rows_per_part`` at a time, on the GPU: each partition in on one stream,
    out (into the same place: its values do not change) on another once it is in, two
    device buffers a slot of four. Both engines busy at once for the whole input, as
    the pinned path's bound assumes but over the run's length, not one partition's best
    burst (:func:`_cuda_ceilings`). ``None`` off the GPU."""
    try:
        import cupy as cp
    except ImportError:
        return None
    if not cp.cuda.is_available():
        return None
    parts = [host[s : s + rows_per_part] for s in range(0, host.shape[0], rows_per_part)]
    slots = 4
    dev = [cp.empty(parts[0].shape, parts[0].dtype) for _ in range(slots)]
    s_in, s_out = cp.cuda.Stream(non_blocking=True), cp.cuda.Stream(non_blocking=True)
    done_out = [None] * slots
    best = float("inf")
    for _ in range(repeat):
        cp.cuda.Device().synchronize()
        t0 = time.perf_counter()
        for i, part in enumerate(parts):
            j = i % slots
            if done_out[j] is not None:
                s_in.wait_event(done_out[j])  # the slot's last partition is out
            d = dev[j][: part.shape[0]]
            d.set(part, stream=s_in)
            arrived = s_in.record()
            s_out.wait_event(arrived)
            d.get(stream=s_out, out=part, blocking=False)
            done_out[j] = s_out.record()
        cp.cuda.Device().synchronize()
        best = min(best, time.perf_counter() - t0)
    return best


@dataclasses.dataclass(frozen=True)
class DefaultInput:
    """The default path's input and kernel (see :func:`default_input`)."""

    host: np.ndarray  # the input, pageable float32
    rows_per_part: int
    x: da.Array  # ``host`` as a Dask array of views, ``rows_per_part`` rows a block
    func: Callable[[Any], Any]  # the balanced kernel
    ceilings: dict  # measure_ceilings' rates
    kernel_seconds: float  # the kernel on one block
    iterations: int


def default_input(rt: Any, size: int, partition: int) -> DefaultInput:
    """``size`` bytes of pageable float32 in blocks of ``partition`` bytes, and the balanced
    kernel measured on one of them: the path users run, as ``bench_default.py`` and the
    diagnostics that look into it (``result_reuse.py``, ``split_gap.py``) make it."""
    rows_per_part = max(1, partition // (4 * COLS))
    host = random_data((max(1, size // (4 * COLS)), COLS))
    ceilings, kernel_s, iterations = measure_ceilings(rt, host[:rows_per_part], "balanced")
    return DefaultInput(
        host,
        rows_per_part,
        array_of_views(host, rows_per_part),
        make_kernel(iterations),
        ceilings,
        kernel_s,
        iterations,
    )


def measure_ceilings(rt: Any, block: np.ndarray, workload: str) -> tuple[dict, float, int]:
    """Stage ceilings for a run's bound, measured (or, on ``timed``, modelled) in this run.

    ``block`` is one partition of the input. Returns the rates in bytes per second
    (``h2d``, ``d2h``, ``both`` when the two directions were measured together,
    ``staging`` for pageable input into the ring, ``fresh`` for results out of it into new
    arrays, both with the copy threads on at least :data:`PROBE_BYTES`; ``host_cores`` on
    the host backend), the kernel's seconds for one partition, and the kernel iterations
    chosen so that the kernel takes ``KERNEL_RATIO[workload]`` times one partition's H2D.
    """
    ratio = KERNEL_RATIO[workload]
    name = rt.backend.name
    if name == "timed":
        return _timed_ceilings(rt, block)
    if name == "cuda":
        return _cuda_ceilings(rt, block, ratio)
    return _host_ceilings(rt, block, ratio)
