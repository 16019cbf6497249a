"""The partition runner: one driver, over the pure engine, for every partition.

:func:`run_partition` lays the partition out in sub-chunks, then drives the engine
(:mod:`.engine`: what may start now, under the bounded window and the ring's room): it
hands each action to an executor (:mod:`.executors`: on this thread for a partition of
one sub-chunk, on the copy threads and the streams otherwise), which does the stage's
work (:mod:`.work`), and feeds each completion back to the engine. When the window is
full, or the pinned ring has no room for the next sub-chunk, the task's thread waits, and
that wait is counted as backpressure.

A partition that fails gives back everything it holds before its exception leaves this
module: every stream it used is drained, every buffer let go, and the frames of the
exception's traceback are cleared, so that no pinned block or device buffer waits for
the garbage collector. The exception keeps its type and carries a note that names the
partition, its blocks, the sub-chunk and the stage.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from .engine import Done, Failed, Pipeline, Stage
from .executors import InlineExecutor, ThreadedExecutor
from .halo import HaloBlock
from .inputs import as_input
from .layout import Layout, auto_sub_chunk_bytes, layout, own_axis, whole
from .pieces import Pieces, PinnedBlocks, join
from .results import partition_name, refuse_block
from .runtime import Runtime
from .work import PartitionWork

__all__ = ["OUT_MODES", "PartitionSpec", "run_partition"]

#: What ``out=`` may be: where a partition's result lives.
OUT_MODES = ("host", "pinned", "device")
#: Whether ``sub-chunk-bytes: auto`` cuts partitions on a backend whose device memory is
#: host memory (the host backend) as it would on a device. It does not (see ``_lay_out``);
#: tests of the cutting that run on the host backend set it (``as_on_a_device``).
AUTO_CUTS_HOST_MEMORY = False
#: A sub-chunk size that cuts no partition (``sub-chunk-bytes: auto`` on the host backend).
_UNCUT = sys.maxsize
#: How long a submitter that holds nothing waits for ring room before it looks again.
_RING_POLL_SECONDS = 1.0
#: What a failed stage was doing, as the note on its error says it.
_DOING = {
    Stage.STAGING: "staging its input into the pinned ring",
    Stage.H2D: "copying its input to the device",
    Stage.COMPUTE: "in func",
    Stage.D2H: "copying its result back",
    Stage.UNSTAGING: "copying its result out of the pinned ring",
}


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
    sub_chunk_bytes: int | str | None  # or "auto" (layout.auto_sub_chunk_bytes); None: rt's
    in_flight: int | None  # None: the runtime's
    block_info: dict | None = None
    func_name: str = "func"
    # What the output array declares for this block (``None``: not known; in the shape,
    # ``None`` for an extent Dask does not know either).
    out_shape: tuple[int | None, ...] | None = None
    out_dtype: Any = None
    # One of OUT_MODES: "host" (an ordinary NumPy array, filled from the ring), "pinned"
    # (a block of the pinned pool), "device" (stays on the device; nothing copied out).
    out: str = "host"
    # Blocks along split_axis that this partition joins (batch=), for errors to name.
    batch: int = 1
    # A fused store's region of its target, to be the output (see .store); None: none.
    into: Any = None


def run_partition(
    runtime: Runtime, func: Callable[..., Any], args: tuple, kwargs: dict, spec: PartitionSpec
) -> Any:
    """Run ``func`` over one partition through the pipeline; return the output block."""
    try:
        return _run(runtime, func, args, kwargs, spec)
    except BaseException as e:
        # Everything the partition held is referenced only by the frames below this one
        # (and by the exception through them): cleared, it is given back now, not at the
        # garbage collector's next pass (pinned blocks and device buffers included).
        _clear_frames(e)
        raise


def _run(
    rt: Runtime, func: Callable[..., Any], args: tuple, kwargs: dict, spec: PartitionSpec
) -> Any:
    counters = rt.counters
    entry = counters.enter()  # running from here: what sizes it counts it
    if spec.in_flight is None:  # left to the runtime (a worker's plugin's options)
        spec.in_flight = rt.options.in_flight
    if spec.sub_chunk_bytes is None:
        spec.sub_chunk_bytes = rt.options.sub_chunk_bytes
    try:
        blocks = list(args)
        try:
            lay = _lay_out(rt, blocks, spec)
        except Exception as e:
            counters.add(partitions=1, partitions_failed=1)  # a failed partition all the same
            e.add_note(f"dask_overlap: {spec.func_name}, {_blocks_of(spec)}")
            raise
        work = PartitionWork(rt, func, blocks, kwargs, spec, lay)
        stall = rt.options.stall_timeout
        executor = (ThreadedExecutor if lay.cut else InlineExecutor)(work, stall)
        counters.add(partitions=1, window_capacity=work.window)
        with work.meter.task():  # digests in this thread: context_meter is a ContextVar
            failure = _drive(work, executor)
    finally:
        counters.leave(entry)
    if failure is not None:
        _raise(work, failure)
    return work.output.array


def _drive(work: PartitionWork, ex: InlineExecutor | ThreadedExecutor) -> Failed | None:
    """The driver loop: the engine's actions to the executor, the executor's events to the
    engine, until every sub-chunk is done or, after a failure, drained. Returns the first
    failure (``None`` when the partition succeeded)."""
    counters, meter = work.rt.counters, work.meter
    pipe = Pipeline(
        len(work.subs),
        work.spec.in_flight,
        staged=[any(s.to_stage) for s in work.subs],
        unstaged=work.spec.out != "device",
        admit=work.admit,
    )
    in_flight, waited = 0, 0.0
    try:
        actions = pipe.start()
        while True:
            if pipe.in_flight != in_flight or work.device_delta:  # the gauges, at once
                counters.add(
                    in_flight=pipe.in_flight - in_flight, device_bytes_in_flight=work.device_delta
                )
                in_flight, work.device_delta = pipe.in_flight, 0
            for action in actions:
                ex.start(action)
            if pipe.done:
                break
            blocked = pipe.blocked
            t0 = time.perf_counter()
            if pipe.stalled and not pipe.in_flight:
                # Nothing of ours is in flight, so nothing of ours holds ring room:
                # waiting for another partition to give some back cannot deadlock.
                work.pool.wait_for_room(work.admission.waiting_for, _RING_POLL_SECONDS)
                waited += time.perf_counter() - t0
                actions = pipe.retry()
                continue
            event = ex.next_event()
            dt = time.perf_counter() - t0
            if blocked:
                waited += dt
            meter.waited(event.stage, dt, blocked)
            if isinstance(event, Done):
                _finished(work, ex, event)
            actions = pipe.handle(event)
    finally:
        failed = pipe.failure is not None or not pipe.done
        try:
            # Nothing is let go of before the streams are done with it.
            if failed and ex.drain():
                work.release()
        finally:  # the gauges and the streams' leases, even where the drain raised
            work.settle(
                failed,
                pipe.max_in_flight,
                {
                    "in_flight": -in_flight,
                    "device_bytes_in_flight": work.device_delta,
                    "backpressure_seconds": waited,
                    "window_capacity": -work.window,
                },
            )
    return pipe.failure


def _finished(work: PartitionWork, ex: InlineExecutor | ThreadedExecutor, event: Done) -> None:
    """Let go of what the completed stage's copies read (see :mod:`.work`)."""
    i = event.index
    if event.stage == Stage.D2H:
        ex.device_done(i)
        if work.spec.out == "device":
            work.record(i)  # nothing to unstage
    elif event.stage == Stage.UNSTAGING:
        work.record(i)


def _raise(work: PartitionWork, failure: Failed) -> None:
    """Re-raise a partition's failure, with a note that says where; an out-of-memory
    error says what ran out and how much was asked."""
    error, spec = failure.error, work.spec
    oom = work.backend.describe_oom(error)
    if oom is not None:
        # The original stays as __cause__ (and in the text, since a cause does not
        # travel with a pickled exception).
        error = MemoryError(
            f"{spec.func_name} ran out of memory in {work.where}: {oom} "
            f"({type(error).__name__}: {error})"
        )
        error.__cause__ = failure.error  # (as ``raise ... from``)
    if isinstance(error, Exception):  # (not a Ctrl-C: that names nothing)
        sub, n = work.lay.plan.sub_chunks[failure.index], len(work.lay.plan)
        rows = f", sub-chunk {sub.index + 1} of {n} (rows {sub.start}:{sub.stop})" if n > 1 else ""
        error.add_note(
            f"dask_overlap: {spec.func_name}, {_blocks_of(spec)}{rows}, failed "
            f"{_DOING[failure.stage]}"
        )
    raise error


def _blocks_of(spec: PartitionSpec) -> str:
    """The partition and, for a batch, the blocks it holds along the split axis."""
    name = partition_name(spec.key)
    axis = spec.out_split_axis
    if spec.batch == 1 or axis is None or len(spec.key) <= axis + 1:
        return name
    first = spec.key[1 + axis] * spec.batch
    return f"{name} ({spec.batch} input blocks from block {first} along axis {spec.split_axis})"


def _clear_frames(error: BaseException) -> None:
    """Clear the locals of every finished frame that ``error``, or an error it was raised
    from, still reaches: those of its traceback and the callers they point back to (a
    failure kept as an event and raised again later leaves the frames that handled it
    between the two), up to the first frame still running (this one's callers stay)."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        tb = error.__traceback__
        while tb is not None:
            frame = tb.tb_frame
            while frame is not None:
                try:
                    frame.clear()
                except RuntimeError:  # still running: so are its callers
                    break
                frame = frame.f_back
            tb = tb.tb_next
        error = error.__cause__ or error.__context__


def _staged(rt: Runtime, args: list[Any], spec: PartitionSpec) -> bool:
    """Whether a cut partition's inputs go through the pinned ring: not where every array
    input is host memory that is pinned already and whose sub-chunks are whole rows of it
    (cut along its first axis, C-contiguous). A batch's blocks, a halo's block and a device
    array keep the staged sizing: their cuts have costs of their own."""
    bytes_in = 0
    for p in spec.array_positions:
        a = args[p]
        if type(a) is not np.ndarray:
            return True
        if a.nbytes and (
            own_axis(spec.split_axis, spec.ndim, a.ndim) > 0
            or as_input(rt.backend, a).needs_staging
        ):
            return True
        bytes_in += a.nbytes
    return not bytes_in


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
        if type(a) is HaloBlock:
            continue  # (its pieces are checked as the graph made them: Dask's blocks)
        if type(a) is not np.ndarray and type(a) is not PinnedBlocks and not is_device(a):
            # A subclass whose meaning the copies would lose.
            refuse_block(a, partition_name(spec.key))
            args[p] = np.asarray(a)
    if spec.split_axis is None:
        return whole(args, spec.array_positions)  # not cut: the size does not matter
    sub_chunk_bytes = spec.sub_chunk_bytes
    if sub_chunk_bytes == "auto" and rt.backend.host_memory and not AUTO_CUTS_HOST_MEMORY:
        # No device (the host backend): every stage of a sub-chunk is work on this
        # machine's cores, so a cut overlaps nothing, costs a copy of each sub-chunk's
        # result into the partition's output (an uncut partition's result is its output)
        # and runs the sub-chunks on the runtime's threads, beside the task threads that
        # the worker's other partitions have. One sub-chunk, laid out as a cut would be.
        sub_chunk_bytes = _UNCUT
    elif sub_chunk_bytes == "auto":
        size = sum(getattr(args[p], "nbytes", 0) for p in spec.array_positions)
        # This partition and those running beside it share the device.
        sub_chunk_bytes = auto_sub_chunk_bytes(
            size, rt.counters.sharing(), _staged(rt, args, spec), spec.batch > 1
        )
    return layout(
        args,
        spec.array_positions,
        spec.ndim,
        spec.split_axis,
        spec.out_split_axis,
        int(sub_chunk_bytes),
        partition_name(spec.key),
    )
