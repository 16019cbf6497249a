"""The partition runner: drives the engine for one partition over a runtime's backend.

The task's thread is the *submitter*: it turns the engine's actions into work on the
staging threads and the streams, and waits for their completions, which come back as
engine events through one queue. When the window is full it waits, and that wait is
counted as backpressure.

Ownership: every buffer of a sub-chunk (pinned staging blocks, device inputs, the device
result) is held in this object until the sub-chunk's copy-out has *completed* on its
stream, then dropped, which returns pinned blocks to the pool. After a failure nothing is
dropped until every stream this partition used has completed, so no asynchronous copy
can outlive its buffer.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import queue
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from .engine import Action, Done, Failed, Pipeline, Plan, Stage, plan_sub_chunks
from .metrics import TaskMeter, nvtx_range

__all__ = ["PartitionSpec", "run_partition"]

# A partition of one sub-chunk up to this size is staged on the task's own thread.
_INLINE_STAGING = 4 << 20
# Staging copies are cut into pieces of at least this size, run by the staging threads.
_STAGING_PIECE = 4 << 20


def _pieces(src: np.ndarray, dst: np.ndarray, threads: int) -> list[tuple[Any, Any]]:
    """``(src, dst)`` row ranges that together copy ``src`` into ``dst``."""
    rows = src.shape[0] if src.ndim else 1
    n = max(1, min(threads, src.nbytes // _STAGING_PIECE, rows))
    if n == 1:
        return [(src, dst)]
    bounds = [rows * k // n for k in range(n + 1)]
    return [(src[lo:hi], dst[lo:hi]) for lo, hi in zip(bounds, bounds[1:], strict=False)]


_SKIPPED = object()  # what a stage returns when an earlier stage of its sub-chunk failed


@dataclasses.dataclass(frozen=True)
class PartitionSpec:
    """What one partition task knows besides its arguments.

    ``split_axis`` is in the index space of the inputs (the highest input ``ndim``, as
    Dask aligns them); ``out_split_axis`` is the same axis in the output.
    """

    key: tuple
    array_positions: tuple[int, ...]
    ndim: int
    split_axis: int | None
    out_split_axis: int | None
    sub_chunk_bytes: int
    in_flight: int
    block_info: dict | None = None
    func_name: str = "func"
    # What the output array declares for this block (``None``: not known; in the shape,
    # ``None`` for an extent Dask does not know either).
    out_shape: tuple[int | None, ...] | None = None
    out_dtype: Any = None
    # "host": the output block is host memory (pinned when the pool can serve);
    # "device": it stays a device array (CuPy on the GPU), and nothing is copied out.
    out: str = "host"


def _along(axis: int, start: int, stop: int) -> tuple[slice, ...]:
    return (slice(None),) * axis + (slice(start, stop),)


def run_partition(
    runtime: Any, func: Callable[..., Any], args: tuple, kwargs: dict, spec: PartitionSpec
) -> Any:
    """Run ``func`` over one partition through the pipeline; return the output block."""
    return _PartitionRun(runtime, func, args, kwargs, spec).run()


class _PartitionRun:
    def __init__(self, rt: Any, func: Callable, args: tuple, kwargs: dict, spec: PartitionSpec):
        self.rt = rt
        self.backend = rt.backend
        self.func = func
        self.args = list(args)
        self.kwargs = kwargs
        self.spec = spec
        self.events: queue.SimpleQueue[Done | Failed] = queue.SimpleQueue()
        for p in spec.array_positions:
            if not self.backend.is_device(self.args[p]) and not isinstance(
                self.args[p], np.ndarray
            ):
                self.args[p] = np.asarray(self.args[p])
        self.axes, self.plan = self._plan()
        # Per sub-chunk state, keyed by sub-chunk index; see the module docstring.
        self.host_in: dict[int, list[Any]] = {}
        self.to_stage: dict[int, list[bool]] = {}
        self.held: dict[int, list[np.ndarray]] = {}
        self.dev_in: dict[int, list[Any]] = {}
        self.dev_out: dict[int, Any] = {}
        self.dev_bytes: dict[int, int] = {}
        self.streams: dict[int, Any] = {}
        self.out: Any = None
        self.out_ready: Any = None  # out="device": a mark made after allocating self.out
        self._out_lock = threading.Lock()
        # Timings: host-side spans (staging) and stream marks, resolved on completion.
        self.spans: dict[int, list[tuple[str, float, float, int]]] = {}
        self.marks: dict[int, list[tuple[str, Any, Any, int]]] = {}
        self.failed: set[int] = set()
        self.meter = TaskMeter(spec.key, self.backend.name, rt, spec.in_flight)  # fine metrics

    # -- planning ---------------------------------------------------------------------
    def _plan(self) -> tuple[dict[int, int | None], Plan]:
        """The split axis of each array input (``None``: passed whole) and the plan."""
        k = self.spec.split_axis
        axes: dict[int, int | None] = {}
        if k is None:
            first = self.args[self.spec.array_positions[0]] if self.spec.array_positions else None
            extent = first.shape[0] if first is not None and first.ndim else 1
            return dict.fromkeys(self.spec.array_positions), Plan(
                None, extent, plan_sub_chunks(extent, 0, 0, None).sub_chunks
            )
        # Dask aligns blocks by position, not shape: inputs may disagree along k. Only an
        # extent of 1 broadcasts; any other mismatch cannot be cut into common sub-chunks.
        extents: dict[int, int] = {}
        for p in self.spec.array_positions:
            a = self.args[p]
            ax = k - (self.spec.ndim - a.ndim)
            if ax >= 0 and a.shape[ax] != 1:
                extents[p] = a.shape[ax]
        if len(set(extents.values())) > 1:
            found = ", ".join(f"arrays[{p}]: {e}" for p, e in extents.items())
            raise ValueError(
                f"split_axis={k} requires the array inputs to have the same extent along it "
                f"(or 1, to broadcast); {self._where()} has extents {found}"
            )
        extent = next(iter(extents.values()), 1)
        row_bytes = 0
        for p in self.spec.array_positions:
            a = self.args[p]
            ax = k - (self.spec.ndim - a.ndim)
            if ax < 0 or (a.shape[ax] == 1 and extent != 1):
                axes[p] = None  # broadcast along the split axis: every sub-chunk gets it whole
            else:
                axes[p] = ax
                if extent:
                    row_bytes += a.nbytes // extent
        if any(self.args[p].size == 0 for p in self.spec.array_positions):
            row_bytes = 0  # nothing to pipeline: one sub-chunk
        return axes, plan_sub_chunks(extent, row_bytes, self.spec.sub_chunk_bytes, k)

    def _inputs(self, i: int) -> list[Any]:
        sub = self.plan.sub_chunks[i]
        out = []
        for p in self.spec.array_positions:
            a, ax = self.args[p], self.axes[p]
            out.append(
                a if ax is None or len(self.plan) == 1 else a[_along(ax, sub.start, sub.stop)]
            )
        return out

    def _needs_staging(self, x: Any) -> bool:
        return (
            not self.backend.is_device(x)
            and x.nbytes > 0
            and (not x.flags.c_contiguous or not self.backend.is_pinned(x))
        )

    # -- the driver loop --------------------------------------------------------------
    def run(self) -> Any:
        counters = self.rt.counters
        counters.add(partitions=1, partitions_active=1)
        try:
            with self.meter.task():  # digests in this thread: context_meter is a ContextVar
                return self._run()
        finally:
            counters.add(partitions_active=-1)

    def _run(self) -> Any:
        counters = self.rt.counters
        n = len(self.plan)
        for i in range(n):
            self.host_in[i] = self._inputs(i)
            # Asked once per input: on CUDA it may be a driver call (pointerGetAttributes).
            self.to_stage[i] = [self._needs_staging(x) for x in self.host_in[i]]
        staged = [any(self.to_stage[i]) for i in range(n)]
        pipe = Pipeline(n, self.spec.in_flight, staged, stream_ordered=True)
        counters.add(sub_chunks=n)
        in_flight = 0
        waited = 0.0
        try:
            actions = pipe.start()
            while True:
                counters.add(in_flight=pipe.in_flight - in_flight)
                in_flight = pipe.in_flight
                self._dispatch(actions)
                if pipe.done:
                    break
                blocked = pipe.blocked
                t0 = time.perf_counter()
                event = self.events.get()
                dt = time.perf_counter() - t0
                if blocked:
                    waited += dt
                self.meter.waited(event.stage, dt, blocked)
                if isinstance(event, Done) and event.stage == Stage.D2H:
                    self._record(event.index)
                    self._release(event.index)
                actions = pipe.handle(event)
        finally:
            counters.add(in_flight=-in_flight, backpressure_seconds=waited)
            counters.add_max(max_window=pipe.max_in_flight)
            if pipe.error is not None or not pipe.done:
                # Nothing is dropped before the streams are done with it.
                self._wait_streams()
                for i in list(self.host_in):
                    self._release(i)
                self.out = None
        if pipe.error is not None:
            counters.add(partitions_failed=1)
            oom = self.backend.describe_oom(pipe.error)
            if oom is not None:
                # Say where and how much; the original stays as __cause__ (and in the text,
                # since a cause does not travel with a pickled exception).
                raise MemoryError(
                    f"{self.spec.func_name} ran out of memory in {self._where()}: {oom} "
                    f"({type(pipe.error).__name__}: {pipe.error})"
                ) from pipe.error
            raise pipe.error
        return self.out

    def _post(self, event: Done | Failed) -> None:
        self.events.put(event)

    def _dispatch(self, actions: list[Action]) -> None:
        # Copies first: every admitted sub-chunk's H2D is queued before any kernel is
        # launched, so the copy engine starts while the host is still launching kernels.
        # (The sort is stable, so each sub-chunk's own stages keep their order.)
        for a in sorted(actions, key=lambda a: a.stage):
            if a.index in self.failed:
                continue  # an earlier stage of it failed; the engine has its Failed event
            try:
                {
                    Stage.STAGE: self._stage,
                    Stage.H2D: self._copy_in,
                    Stage.COMPUTE: self._compute,
                    Stage.D2H: self._copy_out,
                }[a.stage](a.index)
            except Exception as e:
                self.failed.add(a.index)
                self._post(Failed(a.stage, a.index, e))

    def _completion(self, stage: Stage, i: int, store: Callable[[Any], None] | None = None):
        def on_done(result: Any, error: BaseException | None) -> None:
            if result is _SKIPPED:
                return
            if error is not None:
                # Marked before the event is posted: the stages of ``i`` already queued
                # behind this one on its stream see it and do nothing.
                self.failed.add(i)
                self._post(Failed(stage, i, error))
                return
            if store is not None:
                store(result)
            self._post(Done(stage, i))

        return on_done

    # -- the four stages --------------------------------------------------------------
    def _stage(self, i: int) -> None:
        """Copy sub-chunk ``i``'s pageable inputs into pinned blocks.

        The blocks are taken here, on the submitter's thread. The copies are cut into
        pieces that the staging threads run in parallel (one thread's memcpy reaches a
        third of what several reach), and the stage is done when the last piece is.
        """
        pool = self.backend.pinned
        inputs = self.host_in[i]
        held, pieces, staged_bytes, fallbacks = [], [], 0, 0
        for j, x in enumerate(inputs):
            if not self.to_stage[i][j]:
                continue
            block = pool.allocate(x.nbytes)
            if block is None:
                # Pool exhausted: copy straight from pageable memory, and say so.
                fallbacks += 1
                continue
            dst = block.view(x.dtype).reshape(x.shape)
            held.append(block)
            inputs[j] = dst  # read by the H2D, which runs only once this stage is done
            staged_bytes += x.nbytes
            pieces += _pieces(x, dst, self.rt.options.staging_threads)
        self.held[i] = held
        self.rt.counters.add(bytes_staged=staged_bytes, pinned_fallbacks=fallbacks)
        self.meter.fallback(fallbacks)
        t0 = time.time()
        finish = self._completion(Stage.STAGE, i)
        if not pieces or (len(self.plan) == 1 and staged_bytes <= _INLINE_STAGING):
            # Nothing of this partition could overlap a small copy: stage it on this thread
            # and spare two thread hand-offs (other partitions overlap on their own threads).
            try:
                for src, dst in pieces:
                    self.backend.stage(src, dst)
            except Exception as e:
                finish(None, e)
                return
            self.spans[i] = [("stage", t0, time.time(), staged_bytes)]
            finish(None, None)
            return
        left = [len(pieces)]
        errors: list[BaseException] = []
        lock = threading.Lock()

        def piece_done(fut: Any) -> None:
            with lock:
                if fut.exception() is not None:
                    errors.append(fut.exception())
                left[0] -= 1
                if left[0]:
                    return
            self.spans[i] = [("stage", t0, time.time(), staged_bytes)]
            finish(None, errors[0] if errors else None)

        for src, dst in pieces:
            self.rt.staging.submit(self.backend.stage, src, dst).add_done_callback(piece_done)

    # H2D, COMPUTE and D2H of a sub-chunk are queued on its stream together (the engine
    # is stream-ordered), so each reads what the stage before it stored when it *runs*.
    def _copy_in(self, i: int) -> None:
        stream = self.streams[i] = self.rt.acquire_stream()
        backend = self.backend

        def work() -> list[Any]:
            inputs = self.host_in[i]
            moved = sum(x.nbytes for x in inputs if not backend.is_device(x))
            with self._marked(i, "h2d", stream, moved):
                # Device inputs go through copy_in too: it orders them on ``stream``.
                copies = [backend.copy_in(stream, x) for x in inputs]
            self.dev_bytes[i] = moved
            self.rt.counters.add(bytes_h2d=moved, device_bytes_in_flight=moved)
            return copies

        stream.submit(work, self._completion(Stage.H2D, i, lambda r: self.dev_in.__setitem__(i, r)))

    def _compute(self, i: int) -> None:
        stream = self.streams[i]
        kwargs = self.kwargs
        if self.spec.block_info is not None:
            kwargs = dict(kwargs, block_info=self._block_info(i))

        def work() -> Any:
            if i in self.failed:
                return _SKIPPED
            args = list(self.args)
            for p, d in zip(self.spec.array_positions, self.dev_in[i], strict=True):
                args[p] = d
            with self._marked(i, "compute", stream, self.dev_bytes.get(i, 0)):
                return self.backend.compute(stream, self.func, args, kwargs)

        stream.submit(
            work, self._completion(Stage.COMPUTE, i, lambda r: self.dev_out.__setitem__(i, r))
        )

    def _copy_out(self, i: int) -> None:
        stream = self.streams[i]
        counters = self.rt.counters

        def work() -> Any:
            if i in self.failed:
                return _SKIPPED
            result, dest = self._check_result(i, stream)
            if self.spec.out == "device":
                if dest is not None:  # one sub-chunk's slice of the partition's output
                    self.backend.wait(stream, self.out_ready)
                    self.backend.place(stream, result, dest)
                return None
            with self._marked(i, "d2h", stream, result.nbytes):
                self.backend.copy_out(stream, result, dest)
            counters.add(bytes_d2h=result.nbytes)
            return None

        def on_done(result: Any, error: BaseException | None) -> None:
            if result is _SKIPPED:
                return
            if error is not None:
                self.failed.add(i)
                self._post(Failed(Stage.D2H, i, error))
            else:
                stream.on_complete(lambda: self._post(Done(Stage.D2H, i)))

        stream.submit(work, on_done)

    @contextlib.contextmanager
    def _marked(self, i: int, stage: str, stream: Any, nbytes: int) -> Iterator[None]:
        """Mark the start and end of an operation in ``stream``'s order (see _record)."""
        start = self.backend.mark(stream)
        with nvtx_range(self.backend.name, self.spec.key, i, stage):
            yield
        self.marks.setdefault(i, []).append((stage, start, self.backend.mark(stream), nbytes))

    def _record(self, i: int) -> None:
        """Hand sub-chunk ``i``'s stage spans to the runtime; its stream work has completed."""
        marks = self.marks.pop(i, [])
        times = self.backend.resolve([m for _, a, b, _ in marks for m in (a, b)])
        spans = self.spans.pop(i, [])
        spans += [(st, times[2 * k], times[2 * k + 1], n) for k, (st, _, _, n) in enumerate(marks)]
        stream = self.streams.get(i)
        self.rt.record_spans(self.spec.key, i, stream, spans)
        self.meter.spans(spans)

    # -- results, output and buffers ---------------------------------------------------
    def _where(self) -> str:
        return f"partition {self.spec.key!r}"

    def _check_result(self, i: int, stream: Any) -> tuple[Any, Any]:
        """The validated device result of sub-chunk ``i`` and where in the output it goes.

        Called in ``stream``'s order. With ``out="device"`` and one sub-chunk, the result
        is the output itself, and the destination ``None``.
        """
        raw = self.dev_out[i]
        result = self.backend.as_result(raw)
        if result is None:
            raise TypeError(
                f"{self.spec.func_name} must return an array, got {type(raw).__name__} "
                f"for {self._where()}"
            )
        self.dev_out[i] = result
        ax = self.spec.out_split_axis
        sub = self.plan.sub_chunks[i]
        if ax is not None:
            got = result.shape[ax] if result.ndim > ax else None
            if got != sub.extent:
                raise ValueError(
                    f"split_axis={self.spec.split_axis} requires {self.spec.func_name} to keep "
                    f"the extent of output axis {ax}: sub-chunk rows [{sub.start}:{sub.stop}] "
                    f"of {self._where()} gave an output of shape {tuple(result.shape)}, "
                    f"expected extent {sub.extent} along axis {ax}"
                )
        with self._out_lock:
            if self.out is None:
                shape = list(result.shape)
                if ax is not None and len(self.plan) > 1:
                    shape[ax] = self.plan.extent
                self._check_declared(tuple(shape), result.dtype)
                if self.spec.out == "device" and len(self.plan) == 1:
                    self.out = result
                    return result, None
                self.out = self._allocate_output(tuple(shape), result.dtype, stream)
                return result, self._dest(i)
        expected = list(self.out.shape)
        got_shape = list(result.shape)
        if ax is not None and len(self.plan) > 1:
            expected[ax] = got_shape[ax] = sub.extent
        if result.dtype != self.out.dtype or got_shape != expected:
            raise ValueError(
                f"{self.spec.func_name} returned dtype {result.dtype} and shape "
                f"{tuple(result.shape)} for sub-chunk rows [{sub.start}:{sub.stop}] of "
                f"{self._where()}, but another sub-chunk gave dtype {self.out.dtype} "
                f"and shape {tuple(expected)}"
            )
        return result, self._dest(i)

    def _check_declared(self, shape: tuple[int, ...], dtype: np.dtype) -> None:
        """The output block must be what the dask array says it is, or Dask's array lies."""
        want_shape, want_dtype = self.spec.out_shape, self.spec.out_dtype
        dtype_ok = want_dtype is None or np.dtype(dtype) == np.dtype(want_dtype)
        shape_ok = want_shape is None or (
            len(shape) == len(want_shape)
            and all(w is None or w == g for w, g in zip(want_shape, shape, strict=True))
        )
        if dtype_ok and shape_ok:
            return
        shown = "?" if want_shape is None else tuple("?" if w is None else w for w in want_shape)
        raise ValueError(
            f"{self.spec.func_name} returned dtype {np.dtype(dtype)} and shape {shape} for "
            f"{self._where()}, but the output array declares dtype "
            f"{'?' if want_dtype is None else np.dtype(want_dtype)} and shape {shown} for "
            "this block: pass dtype= and chunks= (or meta=) to map_blocks as func returns them"
        )

    def _dest(self, i: int) -> Any:
        if len(self.plan) == 1:
            return self.out
        sub = self.plan.sub_chunks[i]
        return self.out[_along(self.spec.out_split_axis, sub.start, sub.stop)]

    def _allocate_output(self, shape: tuple[int, ...], dtype: np.dtype, stream: Any) -> Any:
        if self.spec.out == "device":
            out = self.backend.empty_device(shape, dtype)
            # The other sub-chunks write into it from their own streams, after this mark.
            self.out_ready = self.backend.mark(stream)
            return out
        nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        if nbytes == 0:
            return np.empty(shape, dtype)
        block = self.backend.pinned.allocate(nbytes)
        if block is None:
            self.rt.counters.add(pinned_fallbacks=1)
            self.meter.fallback(1)
            return np.empty(shape, dtype)
        return block.view(dtype).reshape(shape)

    def _release(self, i: int) -> None:
        stream = self.streams.pop(i, None)
        if stream is not None:
            self.rt.release_stream(stream)
        self.host_in.pop(i, None)
        self.to_stage.pop(i, None)
        self.held.pop(i, None)
        self.dev_in.pop(i, None)
        self.dev_out.pop(i, None)
        moved = self.dev_bytes.pop(i, 0)
        if moved:
            self.rt.counters.add(device_bytes_in_flight=-moved)

    def _wait_streams(self) -> None:
        """Block until all work this partition put on its streams has completed."""
        used = {id(s): s for s in self.streams.values()}.values()
        done = threading.Semaphore(0)
        for s in used:
            s.on_complete(done.release)
        for _ in used:
            done.acquire()

    def _block_info(self, i: int) -> dict:
        """The partition's ``block_info``, narrowed to sub-chunk ``i``."""
        info = self.spec.block_info
        if len(self.plan) == 1 or info is None:
            return info
        sub = self.plan.sub_chunks[i]
        info = copy.deepcopy(info)
        for p in self.spec.array_positions:
            ax = self.axes[p]
            if ax is not None and p in info:
                lo, _ = info[p]["array-location"][ax]
                info[p]["array-location"][ax] = (lo + sub.start, lo + sub.stop)
        ax = self.spec.out_split_axis
        if None in info and ax is not None:
            lo, _ = info[None]["array-location"][ax]
            info[None]["array-location"][ax] = (lo + sub.start, lo + sub.stop)
            shape = list(info[None]["chunk-shape"])
            shape[ax] = sub.extent
            info[None]["chunk-shape"] = tuple(shape)
        return info
