"""The partition runner: drives the engine for one partition over a runtime's backend.

The task's thread is the *submitter*: it turns the engine's actions into work on the copy
threads and the streams, and waits for their completions, which come back as engine
events through one queue. When the window is full, or the pinned ring has no room for
the next sub-chunk, it waits, and that wait is counted as backpressure.

The memory model (see ``backends/base.HostPool``): pinned memory is the pipeline's
working set, never what Dask holds. Before a sub-chunk is admitted it reserves room in
the ring for its staged inputs and its copied-out result; pageable input is staged into
it by the copy threads, the device result is copied back into it, and the copy threads
then copy it into the partition's result ("unstaging"), an ordinary NumPy array by
default (``out="host"``). ``out="pinned"`` keeps the result in the pool instead (bounded,
counted); ``out="device"`` keeps it on the device.

Ownership: every buffer of a sub-chunk (ring blocks, device inputs, the device result)
is held by its :class:`~dask_overlap.pipeline.subchunks.SubChunk` until the copy that reads it has
*completed*: inputs and device buffers until the D2H's completion, the ring's copy of
the result until it is unstaged. After a failure nothing is dropped before every stream
this partition used has completed, so no asynchronous copy can outlive its buffer.
"""

from __future__ import annotations

import contextlib
import dataclasses
import queue
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from ..backends import Stream
from .engine import Action, Done, Failed, Pipeline, Stage
from .layout import Layout, auto_sub_chunk_bytes, layout, whole
from .meter import TaskMeter
from .nvtx import nvtx_range
from .output import PartitionOutput
from .pieces import Pieces, PinnedBlocks, join
from .results import check_split_extent, not_an_array, partition_name, refuse_block
from .runtime import Runtime
from .subchunks import Admission, SubChunk

__all__ = ["OUT_MODES", "PartitionSpec", "run_partition"]

#: What ``out=`` may be: where a partition's result lives.
OUT_MODES = ("host", "pinned", "device")
#: How long a submitter that holds nothing waits for ring room before it looks again.
_RING_POLL_SECONDS = 1.0
_KEPT = contextlib.nullcontext()


def _no_mark(stream: Any) -> None:
    """A partition not timed on the device marks nothing."""


@dataclasses.dataclass(slots=True)  # one per task: slots, not frozen, are cheap to make
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
    sub_chunk_bytes: int | str  # or "auto" (see layout.auto_sub_chunk_bytes)
    in_flight: int
    block_info: dict | None = None
    func_name: str = "func"
    # What the output array declares for this block (``None``: not known; in the shape,
    # ``None`` for an extent Dask does not know either).
    out_shape: tuple[int | None, ...] | None = None
    out_dtype: Any = None
    # One of OUT_MODES: "host" (an ordinary NumPy array, filled from the ring), "pinned"
    # (a block of the pinned pool), "device" (stays on the device; nothing copied out).
    out: str = "host"


def run_partition(
    runtime: Runtime, func: Callable[..., Any], args: tuple, kwargs: dict, spec: PartitionSpec
) -> Any:
    """Run ``func`` over one partition through the pipeline; return the output block."""
    blocks = list(args)
    lay = _lay_out(runtime, blocks, spec)
    return (_EngineRun if lay.cut else _LeanRun)(runtime, func, blocks, kwargs, spec, lay).run()


def _lay_out(rt: Runtime, args: list[Any], spec: PartitionSpec) -> Layout:
    """The partition's blocks as plain arrays (in ``args``, in place), and its layout."""
    is_device = rt.backend.is_device
    for p in spec.array_positions:
        a = args[p]
        if type(a) is Pieces:  # several blocks for one partition (batch=): one array
            a, copied = join(rt, a, partition_name(spec.key))
            args[p] = a
            if copied:
                rt.counters.add(bytes_staged=copied)
            if type(a) is PinnedBlocks:
                continue  # copied to the device block by block
        if type(a) is not np.ndarray and not is_device(a):
            # A subclass whose meaning the copies would lose.
            refuse_block(a, partition_name(spec.key))
            args[p] = np.asarray(a)
    if spec.split_axis is None:
        return whole(args, spec.array_positions)  # not cut: the size does not matter
    sub_chunk_bytes = spec.sub_chunk_bytes
    if sub_chunk_bytes == "auto":
        size = sum(getattr(args[p], "nbytes", 0) for p in spec.array_positions)
        # This partition and those already running share the device.
        sub_chunk_bytes = auto_sub_chunk_bytes(size, rt.counters.partitions_active + 1)
    return layout(
        args,
        spec.array_positions,
        spec.ndim,
        spec.split_axis,
        spec.out_split_axis,
        int(sub_chunk_bytes),
        partition_name(spec.key),
    )


class _PartitionRun:
    """One partition's state and its stages, shared by the two drivers below: what the
    task's thread enqueues, and what it lets go of once the copies that read it completed.

    Slotted, and no more made per partition than its path uses: a partition of small
    blocks spends about as long building this as running its stages."""

    __slots__ = (
        "admission",
        "args",
        "backend",
        "events",
        "func",
        "kwargs",
        "lay",
        "meter",
        "output",
        "pool",
        "rt",
        "spec",
        "subs",
        "tally",
        "window",
    )

    #: Completions coming back to the driver: only the engine's path has them (and makes
    #: the queue); the stages that post to it run on that path alone.
    events: queue.SimpleQueue[Done | Failed]

    def __init__(
        self,
        rt: Runtime,
        func: Callable,
        args: list[Any],
        kwargs: dict,
        spec: PartitionSpec,
        lay: Layout,
    ):
        backend = self.backend = rt.backend
        self.rt = rt
        self.pool = backend.pinned
        self.func = func
        self.args = args
        self.kwargs = kwargs
        self.spec = spec
        self.lay = lay
        self.admission = admission = Admission(
            backend,
            rt.direct_bytes,
            lay,
            args,
            spec.out,
            spec.out_shape,
            spec.out_dtype,
        )
        n = len(lay.plan.sub_chunks)
        self.subs = list(map(admission.sub_chunk, range(n)))
        self.output = PartitionOutput(backend, lay, spec)
        # Tallies of this partition, flushed into the runtime's counters once, at its end
        # (one locked update, not one per stage); kept by the driver thread only.
        self.tally = {"bytes_staged": 0, "bytes_h2d": 0, "bytes_d2h": 0, "bytes_unstaged": 0}
        self.meter = TaskMeter(spec.key, backend.name)
        # Sub-chunks this partition may have in flight at once; while it runs, they count
        # in the runtime's window_capacity.
        self.window = min(spec.in_flight, n)

    @property
    def where(self) -> str:
        """How errors name this partition (formatted only for an error)."""
        return partition_name(self.spec.key)

    def _admit(self, i: int) -> bool:
        """The engine's question: may sub-chunk ``i`` start now? (see Admission.admit)"""
        return self.admission.admit(i, self.subs[i])

    def _settle(self, failed: bool, max_window: int, amounts: dict[str, float]) -> None:
        """This partition's tallies into the runtime's counters, in one locked update (both
        paths), plus what the path itself adds in ``amounts`` (counters other than the
        tally's own, which it would replace); fallbacks to the meter."""
        fallbacks = self.output.fallbacks
        for sub in self.subs:
            fallbacks += sub.fallbacks
        tally = self.tally
        tally.update(amounts)
        tally["partitions_failed"] = int(failed)
        tally["sub_chunks"] = len(self.subs)
        tally["pinned_fallbacks"] = fallbacks
        tally["ring_full"] = self.admission.ring_full
        self.rt.counters.settle(tally, max_window, self.meter.busy)
        if fallbacks:
            self.meter.fallback(fallbacks)

    def _raise(self, error: BaseException) -> None:
        """Re-raise a partition's failure; an out-of-memory error says where and how much."""
        oom = self.backend.describe_oom(error)
        if oom is not None:
            # The original stays as __cause__ (and in the text, since a cause does not
            # travel with a pickled exception).
            raise MemoryError(
                f"{self.spec.func_name} ran out of memory in {self.where}: {oom} "
                f"({type(error).__name__}: {error})"
            ) from error
        raise error

    # -- the stages -------------------------------------------------------------------
    def _post(self, event: Done | Failed) -> None:
        self.events.put(event)

    def _stage_copies(self, i: int) -> list[tuple[Any, Any]]:
        """Sub-chunk ``i``'s staging copies, into blocks taken from its ring room (the
        sub-chunk reads its inputs from those blocks from now on)."""
        sub = self.subs[i]
        copies = []
        for j, x in enumerate(sub.inputs):
            if not sub.to_stage[j]:
                continue
            block = sub.res.take(x.nbytes) if sub.res is not None else None
            if block is None:
                sub.fallbacks += 1  # no room: copied straight from pageable memory
                continue
            dst = block.view(x.dtype).reshape(x.shape)
            sub.inputs[j] = dst  # read by the H2D, issued only once this stage is done
            copies.append((x, dst))
        self.tally["bytes_staged"] += sum(src.nbytes for src, _ in copies)
        return copies

    def _copy_now(self, sub: SubChunk, stage: Stage, copies: list, fn: Callable) -> None:
        """``copies`` of ``sub``, done before this returns (the lean path's stages)."""
        t0 = time.time()
        self.rt.copies.run(copies, fn)
        sub.spans.append((stage.name.lower(), t0, time.time(), sum(s.nbytes for s, _ in copies)))

    def _device_work(self, i: int, stream: Any, timed: bool = True) -> Callable[[], None]:
        """What enqueues sub-chunk ``i``'s H2D, COMPUTE and D2H on ``stream``, with a mark
        around each when ``timed`` (run in the stream's order, by :meth:`Stream.submit`
        or ``run``)."""
        sub, backend = self.subs[i], self.backend
        kwargs = self.kwargs
        if self.spec.block_info is not None:
            kwargs = dict(kwargs, block_info=self.lay.block_info(self.spec.block_info, i))
        mark = backend.mark if timed else _no_mark
        # Device memory that ends with the partition may come from the backend's cache;
        # a result left on the device does not.
        scratch = _KEPT if self.spec.out == "device" else backend.scratch()

        def work() -> None:
            with nvtx_range(backend.name, self.spec.key, i, "device"), scratch:
                marks = [mark(stream)]
                dev = []
                for x in sub.inputs:
                    if type(x) is PinnedBlocks:  # a batch's pinned blocks (pieces.py)
                        dev.append(backend.copy_in_blocks(stream, x))
                    else:
                        dev.append(backend.copy_in(stream, x))
                marks.append(mark(stream))
                sub.stage_now = Stage.COMPUTE
                args = list(self.args)
                for p, d in zip(self.lay.axes, dev, strict=True):
                    args[p] = d
                raw = backend.compute(stream, self.func, args, kwargs)
                sub.device = (dev, raw)  # held until the D2H has completed
                marks.append(mark(stream))
                sub.stage_now = Stage.D2H
                self._copy_out(i, sub, raw, stream)
                marks.append(mark(stream))
                if timed:
                    sub.marks = marks

        return work

    def _copy_out(self, i: int, sub: SubChunk, raw: Any, stream: Any) -> None:
        """Validate ``func``'s result and enqueue its copy out (in ``stream``'s order)."""
        result = self.backend.as_result(raw)
        if result is None:
            raise not_an_array(self.spec.func_name, raw, self.where)
        sub.device = (sub.device[0], result)
        spec = self.spec
        plan_sub = self.lay.plan.sub_chunks[i]
        if spec.out_split_axis is not None:
            check_split_extent(
                spec.func_name, spec.split_axis, spec.out_split_axis, result, plan_sub, spec.key
            )
        dest = self.output.slot(i, result, stream, sub.direct)
        if dest is None:  # the result is the partition's output: nothing to copy
            return
        if spec.out == "device":  # one sub-chunk's slice of the partition's output
            self.backend.wait(stream, self.output.ready)
            self.backend.place(stream, result, dest)
            return
        target = dest
        if not sub.direct and dest.nbytes and not self.pool.owns(dest):
            # Into the ring first, then unstaged into ``dest`` by the copy threads: a
            # copy from the device into fresh pageable memory is the naive path's slowest.
            block = sub.res.take(result.nbytes) if sub.res is not None else None
            if block is None:
                sub.fallbacks += 1
            else:
                target = sub.ring_out = block.view(result.dtype).reshape(result.shape)
                sub.dest = dest
        if sub.res is not None:
            sub.res.close()  # room reserved but not needed (e.g. a pinned result)
        self.backend.copy_out(stream, result, target)
        sub.d2h_bytes = result.nbytes

    # -- letting go ------------------------------------------------------------------
    def _resolve_marks(self, sub: SubChunk) -> list[tuple[str, float, float, int]]:
        """Turn the completed sub-chunk's stream marks into spans (added to its own, and
        returned; none when it was not timed)."""
        if len(sub.marks) != 4:
            return []
        t = self.backend.resolve(sub.marks)
        spans = [
            ("h2d", t[0], t[1], sub.h2d_bytes),
            ("compute", t[1], t[2], sub.h2d_bytes),
            ("d2h", t[2], t[3], sub.d2h_bytes),
        ]
        sub.spans += spans
        sub.marks = []
        return spans

    def _record(self, i: int) -> None:
        """Hand sub-chunk ``i``'s spans to the runtime and the meter; let go of it."""
        sub = self.subs[i]
        self.rt.record_spans(self.spec.key, i, sub.stream, sub.spans)
        self.meter.spans(sub.spans)
        self._drop(i)

    def _off_device(self, sub: SubChunk) -> None:
        """Let go of the device buffers and staged inputs (their copies have completed)."""
        if sub.on_device:
            sub.on_device = False
            self.rt.counters.add(device_bytes_in_flight=-sub.h2d_bytes)
        sub.device = sub.inputs = None

    def _drop(self, i: int) -> None:
        sub = self.subs[i]
        self._off_device(sub)
        if sub.res is not None:
            sub.res.close()
        sub.res = sub.ring_out = sub.dest = None
        sub.spans = []

    def _wait_streams(self, streams: Iterable[Stream]) -> None:
        """Block until all work this partition put on ``streams`` has completed."""
        used = list(streams)
        done = threading.Semaphore(0)
        for s in used:
            s.on_complete(lambda _error: done.release())
        for _ in used:
            done.acquire()


class _LeanRun(_PartitionRun):
    """The driver of a partition of one sub-chunk (see :meth:`run`)."""

    __slots__ = ()

    def run(self) -> Any:
        """A partition of one sub-chunk: nothing of it can overlap anything else of it, so
        the task's thread runs its stages itself, in order, with no engine, no events and
        no hand-off to another thread (copies too large for one thread still go to the
        copy threads). Its window is one sub-chunk; the counters, the timeline and the
        task's metrics are fed as on the engine's path, in one locked update at the end."""
        rt, sub, meter = self.rt, self.subs[0], self.meter
        counters = rt.counters
        counters.add(
            partitions=1,
            partitions_active=1,
            window_capacity=self.window,
            in_flight=1,
            device_bytes_in_flight=sub.h2d_bytes,
        )
        stream = error = None
        try:
            # (A sub-chunk that reserves no ring room, as a direct one, is admitted at once.)
            while sub.need != 0 and not self._admit(0):
                # No room: this partition holds none while it waits.
                t0 = time.perf_counter()
                self.pool.wait_for_room(self.admission.waiting_for, _RING_POLL_SECONDS)
                meter.backpressure += time.perf_counter() - t0
            if not sub.direct and any(sub.to_stage):
                self._copy_now(sub, Stage.STAGING, self._stage_copies(0), self.backend.stage)
            # Timed on the device, or now and then only (see sampling.py).
            sampler, name = rt.sampler, self.spec.key[0]
            timed = sampler is None or sampler.due(name, sub.h2d_bytes, time.monotonic())
            stream = sub.stream = rt.acquire_stream()
            start = time.time()
            try:
                stream.run(self._device_work(0, stream, timed))
            finally:
                rt.release_stream(stream)
            if timed:
                spans = self._resolve_marks(sub)
                if sampler is not None:
                    sampler.learn(name, spans)
            else:
                h2d = sub.h2d_bytes
                nbytes = {"h2d": h2d, "compute": h2d, "d2h": sub.d2h_bytes}
                sub.spans += sampler.estimate(name, start, nbytes)
                self.tally["sub_chunks_estimated"] = 1
            if sub.ring_out is not None:
                self._copy_now(
                    sub, Stage.UNSTAGING, [(sub.ring_out, sub.dest)], self.backend.unstage
                )
                self.tally["bytes_unstaged"] += sub.ring_out.nbytes
            self.tally["bytes_h2d"] += sub.h2d_bytes
            self.tally["bytes_d2h"] += sub.d2h_bytes
            rt.record_spans(self.spec.key, 0, stream, sub.spans)
            meter.spans(sub.spans)
        except BaseException as e:  # func's Ctrl-C too: drained, counted, re-raised
            error = e
            if stream is not None:
                # Nothing is dropped before the stream is done with it.
                self._wait_streams((stream,))
            self.output.array = None
        finally:
            self._drop(0)
            self._settle(
                error is not None,
                1,
                {
                    "partitions_active": -1,
                    "window_capacity": -self.window,
                    "in_flight": -1,
                    "device_bytes_in_flight": -sub.h2d_bytes,
                    "backpressure_seconds": meter.backpressure,
                },
            )
            meter.digest()  # in this thread: context_meter is a ContextVar
        if error is not None:
            self._raise(error)
        return self.output.array


class _EngineRun(_PartitionRun):
    """The driver of a partition of several sub-chunks: the engine decides what starts
    when, and the stages' completions come back to this thread as its events."""

    __slots__ = ("failed", "leased", "used_streams")

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.events: queue.SimpleQueue[Done | Failed] = queue.SimpleQueue()
        self.leased: set[int] = set()  # sub-chunks holding a stream lease
        self.used_streams: dict[int, Stream] = {}
        self.failed: set[int] = set()  # sub-chunks a stage of which failed

    def run(self) -> Any:
        counters = self.rt.counters
        counters.add(partitions=1, partitions_active=1, window_capacity=self.window)
        try:
            with self.meter.task():  # digests in this thread: context_meter is a ContextVar
                return self._drive()
        finally:
            counters.add(partitions_active=-1, window_capacity=-self.window)

    def _drive(self) -> Any:
        counters = self.rt.counters
        n = len(self.subs)
        pipe = Pipeline(
            n,
            self.spec.in_flight,
            staged=[any(s.to_stage) for s in self.subs],
            unstaged=self.spec.out != "device",
            admit=self._admit,
        )
        in_flight = 0
        waited = 0.0
        try:
            actions = pipe.start()
            while True:
                if pipe.in_flight != in_flight:
                    counters.add(in_flight=pipe.in_flight - in_flight)
                    in_flight = pipe.in_flight
                self._dispatch(actions)
                if pipe.done:
                    break
                blocked = pipe.blocked
                t0 = time.perf_counter()
                if pipe.stalled and not pipe.in_flight:
                    # Nothing of ours is in flight, so nothing of ours holds ring room:
                    # waiting for another partition to give some back cannot deadlock.
                    self.pool.wait_for_room(self.admission.waiting_for, _RING_POLL_SECONDS)
                    waited += time.perf_counter() - t0
                    actions = pipe.retry()
                    continue
                event = self.events.get()
                dt = time.perf_counter() - t0
                if blocked:
                    waited += dt
                self.meter.waited(event.stage, dt, blocked)
                if isinstance(event, Done):
                    self._finished(event)
                actions = pipe.handle(event)
        finally:
            failed = pipe.error is not None or not pipe.done
            if failed:
                # Nothing is dropped before the streams are done with it.
                self._wait_streams(self.used_streams.values())
                for i in self.leased:  # sub-chunks that failed on the device or in D2H
                    self.rt.release_stream(self.subs[i].stream)
                self.leased.clear()
                for i in range(n):
                    self._drop(i)
                self.output.array = None
            self._settle(
                pipe.error is not None,
                pipe.max_in_flight,
                {"in_flight": -in_flight, "backpressure_seconds": waited},
            )
        if pipe.error is not None:
            self._raise(pipe.error)
        return self.output.array

    def _dispatch(self, actions: list[Action]) -> None:
        # H2D, COMPUTE and D2H of a sub-chunk come together (see the engine) and are
        # enqueued as one: the H2D action starts them, the other two have nothing to do.
        for a in actions:
            if a.index in self.failed:
                continue  # an earlier stage of it failed; the engine has its Failed event
            try:
                if a.stage == Stage.STAGING:
                    self._stage(a.index)
                elif a.stage == Stage.H2D:
                    self._device(a.index)
                elif a.stage == Stage.UNSTAGING:
                    self._unstage(a.index)
            except Exception as e:
                self.failed.add(a.index)
                self._post(Failed(a.stage, a.index, e))

    def _finished(self, event: Done) -> None:
        """Let go of what the completed stage's copies read (see the module docstring)."""
        i = event.index
        sub = self.subs[i]
        if event.stage == Stage.D2H:
            self._resolve_marks(sub)
            self.rt.release_stream(sub.stream)
            self.leased.discard(i)
            self.tally["bytes_h2d"] += sub.h2d_bytes
            self.tally["bytes_d2h"] += sub.d2h_bytes
            self._off_device(sub)
            if self.spec.out == "device":
                self._record(i)
        elif event.stage == Stage.UNSTAGING:
            if sub.ring_out is not None:
                self.tally["bytes_unstaged"] += sub.ring_out.nbytes
            self._record(i)

    def _callback(self, i: int, stage: Stage, fn: Callable[..., None]) -> Callable[..., None]:
        """``fn`` to be called back from another thread for sub-chunk ``i``: should it raise,
        the sub-chunk fails with that error, rather than leave the driver waiting for an
        event that would never come."""

        def call(*args: Any) -> None:
            try:
                fn(*args)
            except BaseException as e:
                self.failed.add(i)
                self.events.put(Failed(stage, i, e))

        return call

    def _host_copy(self, i: int, stage: Stage, copies: list, fn: Callable) -> None:
        """``copies`` of sub-chunk ``i`` on the copy threads; ``stage`` is done when all are
        (a Done event, from the thread that finished the last piece)."""
        sub = self.subs[i]
        nbytes = sum(src.nbytes for src, _ in copies)
        t0 = time.time()

        def done(error: BaseException | None) -> None:
            if error is not None:
                self.failed.add(i)
                self._post(Failed(stage, i, error))
                return
            sub.spans.append((stage.name.lower(), t0, time.time(), nbytes))
            self._post(Done(stage, i))

        self.rt.copies.copy(copies, fn, self._callback(i, stage, done))  # overlapped

    def _stage(self, i: int) -> None:
        """Copy sub-chunk ``i``'s pageable inputs into its ring room, in parallel pieces."""
        self._host_copy(i, Stage.STAGING, self._stage_copies(i), self.backend.stage)

    def _device(self, i: int) -> None:
        """H2D, COMPUTE and D2H of sub-chunk ``i``, enqueued together on one stream; its
        completion comes back as one D2H event, from the stream's waiter."""
        sub = self.subs[i]
        stream = sub.stream = self.rt.acquire_stream()
        self.used_streams[id(stream)] = stream
        self.leased.add(i)
        self.rt.counters.add(device_bytes_in_flight=sub.h2d_bytes)
        sub.on_device = True

        def completed(error: BaseException | None) -> None:
            self._post(Failed(Stage.D2H, i, error) if error else Done(Stage.D2H, i))

        def issued(_: Any, error: BaseException | None) -> None:
            if error is not None:
                self.failed.add(i)
                self._post(Failed(sub.stage_now, i, error))
            else:
                stream.on_complete(self._callback(i, Stage.D2H, completed))

        stream.submit(self._device_work(i, stream), self._callback(i, Stage.H2D, issued))

    def _unstage(self, i: int) -> None:
        """Copy sub-chunk ``i``'s result out of the ring into the partition's result."""
        sub = self.subs[i]
        if sub.ring_out is None:  # it went straight into the result
            self._post(Done(Stage.UNSTAGING, i))
            return
        self._host_copy(i, Stage.UNSTAGING, [(sub.ring_out, sub.dest)], self.backend.unstage)
