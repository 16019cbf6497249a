"""One partition's state, and the work of each stage of its sub-chunks.

:class:`PartitionWork` holds what a partition task has while it runs (its layout, its
sub-chunks, its output, its tallies) and does each stage's work for one sub-chunk:
the staging copies into the ring, the device work (H2D, ``func``, D2H, enqueued on one
stream), the unstaging copy, and letting go of what a completed copy read. *When* each
runs, and on which thread, is the executor's (:mod:`.executors`); *what* starts next is
the engine's (:mod:`.engine`); the driver (:mod:`.partition`) joins them.

The memory model (see ``backends/base.HostPool``): pinned memory is the pipeline's
working set, never what Dask holds. Before a sub-chunk is admitted it reserves room in
the ring for its staged inputs and its copied-out result; pageable input is staged into
it by the copy threads, the device result is copied back into it, and the copy threads
then copy it into the partition's result ("unstaging"), an ordinary NumPy array by
default (``out="host"``). ``out="pinned"`` keeps the result in the pool instead (bounded,
counted); ``out="device"`` keeps it on the device.

Ownership: every buffer of a sub-chunk (ring blocks, device inputs, the device result)
is held by its :class:`~dask_overlap.pipeline.subchunks.SubChunk` until the copy that
reads it has *completed*: inputs and device buffers until the D2H's completion, the
ring's copy of the result until it is unstaged. After a failure nothing is dropped
before every stream this partition used has completed, so no asynchronous copy can
outlive its buffer.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import Any

from .blocks import PerBlock, fetched_dict
from .engine import Stage
from .halo import HALO_KWARG
from .inputs import HaloInput, as_input
from .layout import Layout
from .meter import TaskMeter
from .nvtx import nvtx_range
from .output import PartitionOutput
from .results import check_split_extent, not_an_array, partition_name
from .runtime import Runtime
from .subchunks import Admission, SubChunk

__all__ = ["PartitionWork"]

_KEPT = contextlib.nullcontext()


def _no_mark(stream: Any) -> None:
    """A sub-chunk not timed on the device marks nothing."""


class PartitionWork:
    """One partition's state and its stages' work (see the module docstring).

    Slotted, and no more made per partition than its path uses: a partition of small
    blocks spends about as long building this as running its stages."""

    __slots__ = (
        "admission",
        "args",
        "backend",
        "device_delta",
        "func",
        "halo",
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

    def __init__(
        self, rt: Runtime, func: Callable, args: list[Any], kwargs: dict, spec: Any, lay: Layout
    ):
        backend = self.backend = rt.backend
        self.rt = rt
        self.pool = backend.pinned
        self.func = func
        self.args = args
        self.kwargs = kwargs
        self.spec = spec
        self.lay = lay
        inputs = {p: as_input(backend, args[p]) for p in lay.axes}
        # Whether any input is a halo's padded block (map_overlap).
        self.halo = any(type(x) is HaloInput for x in inputs.values())
        self.admission = admission = Admission(
            backend, rt.direct_bytes, lay, inputs, spec.out, spec.out_shape, spec.out_dtype
        )
        self.subs = list(map(admission.sub_chunk, range(len(lay.plan.sub_chunks))))
        self.output = PartitionOutput(backend, lay, spec, rt.results)
        # Tallies of this partition, flushed into the runtime's counters once, at its end
        # (one locked update, not one per stage); kept by the driver's thread only.
        self.tally = {"bytes_staged": 0, "bytes_h2d": 0, "bytes_d2h": 0, "bytes_unstaged": 0}
        self.meter = TaskMeter(spec.key, backend.name)
        # Sub-chunks this partition may have in flight at once; while it runs, they count
        # in the runtime's window_capacity.
        self.window = min(spec.in_flight, len(self.subs))
        # Bytes put on the device (+) or let go of (-) since the driver last told the
        # runtime's device_bytes_in_flight (it does so with in_flight, in one update).
        self.device_delta = 0

    @property
    def where(self) -> str:
        """How errors name this partition (formatted only for an error)."""
        return partition_name(self.spec.key)

    def admit(self, i: int) -> bool:
        """The engine's question: may sub-chunk ``i`` start now? (see Admission.admit)"""
        return self.admission.admit(i, self.subs[i])

    # -- host copies -------------------------------------------------------------------
    def stage_copies(self, i: int) -> list[tuple[Any, Any]]:
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
            sub.inputs[j] = staged = x.staged(block)  # what the H2D, issued next, reads
            copies.extend(x.staging_copies(staged))
        self.tally["bytes_staged"] += sum(src.nbytes for src, _ in copies)
        return copies

    def unstage_copies(self, i: int) -> list[tuple[Any, Any]]:
        """Sub-chunk ``i``'s copy out of the ring into the partition's result (none when
        its result went straight there)."""
        sub = self.subs[i]
        if sub.ring_out is None:
            return []
        self.tally["bytes_unstaged"] += sub.ring_out.nbytes
        return [(sub.ring_out, sub.dest)]

    # -- the device stages -------------------------------------------------------------
    def device_work(self, i: int, stream: Any, timed: bool) -> Callable[[], None]:
        """What enqueues sub-chunk ``i``'s H2D, COMPUTE and D2H on ``stream``, with a mark
        around each when ``timed`` (run in the stream's order, by ``Stream.submit`` or
        ``run``). ``sub.stage_now`` names the stage an error comes from."""
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
                sub.stage_now = Stage.H2D
                dev = [x.to_device(backend, stream) for x in sub.inputs]
                marks.append(mark(stream))
                sub.stage_now = Stage.COMPUTE
                args = list(self.args)
                for p, d in zip(self.lay.axes, dev, strict=True):
                    args[p] = d
                call = kwargs
                if self.halo:  # what each padded block holds of halo, for HaloFunc's trim
                    margins = tuple(getattr(x, "margins", None) for x in sub.inputs)
                    call = dict(kwargs, **{HALO_KWARG: margins})
                raw = backend.compute(stream, self.func, args, call)
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
        if isinstance(raw, dict) and not self.lay.cut:
            self._partial_out(sub, raw, stream)
            return
        if type(raw) is PerBlock and not self.lay.cut:
            self._per_block_out(sub, raw, stream)
            return
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

    def _partial_out(self, sub: SubChunk, partial: dict, stream: Any) -> None:
        """A reduction's partial of the whole partition, a dict of small arrays (a fused
        ``mean``'s or ``var``'s first step): it is the output, its arrays copied back one
        by one (on the device with ``out="device"``)."""
        backend = self.backend
        keep = self.spec.out == "device"
        out = (
            partial
            if keep
            else fetched_dict(partial, backend.is_device, lambda v: backend.fetch(stream, v))
        )
        sub.device = (sub.device[0], partial)
        sub.d2h_bytes = 0 if keep else sum(getattr(v, "nbytes", 0) for v in out.values())
        self.output.array = out

    def _per_block_out(self, sub: SubChunk, results: PerBlock, stream: Any) -> None:
        """A step's results on each block of a batch (see :mod:`.blocks`): they are the
        output, a tuple, copied back (in one copy where their arrays can be joined; on
        the device with ``out="device"``)."""
        backend = self.backend
        if self.spec.out == "device":
            out = tuple(results.results)
        else:
            out = results.fetched(backend.is_device, lambda v: backend.fetch(stream, v))
        sub.device = (sub.device[0], results)
        nbytes = [
            getattr(v, "nbytes", 0) for r in out for v in (r.values() if type(r) is dict else [r])
        ]
        sub.d2h_bytes = 0 if self.spec.out == "device" else sum(nbytes)
        self.output.array = out

    def device_done(self, i: int, start: float) -> None:
        """Sub-chunk ``i``'s D2H has completed (its device work began at ``start``): its
        stage spans, timed on the device or estimated (see ``sampling``), and its tallies;
        its device buffers and staged inputs are let go."""
        sub, sampler = self.subs[i], self.rt.sampler
        if sub.marks:
            t = self.backend.resolve(sub.marks)
            sub.marks = []
            spans = [
                ("h2d", t[0], t[1], sub.h2d_bytes),
                ("compute", t[1], t[2], sub.h2d_bytes),
                ("d2h", t[2], t[3], sub.d2h_bytes),
            ]
            sub.spans += spans
            if sampler is not None:
                sampler.learn(self.spec.key[0], spans)
        else:
            nbytes = {"h2d": sub.h2d_bytes, "compute": sub.h2d_bytes, "d2h": sub.d2h_bytes}
            sub.spans += sampler.estimate(self.spec.key[0], start, nbytes)
            self.tally["sub_chunks_estimated"] = self.tally.get("sub_chunks_estimated", 0) + 1
        self.tally["bytes_h2d"] += sub.h2d_bytes
        self.tally["bytes_d2h"] += sub.d2h_bytes
        self.off_device(sub)

    # -- letting go ------------------------------------------------------------------
    def record(self, i: int) -> None:
        """Hand sub-chunk ``i``'s spans to the runtime and the meter; let go of it."""
        sub = self.subs[i]
        self.rt.record_spans(self.spec.key, i, sub.stream, sub.spans)
        self.meter.spans(sub.spans)
        self.drop(i)

    def off_device(self, sub: SubChunk) -> None:
        """Let go of the device buffers and staged inputs (their copies have completed)."""
        if sub.on_device:
            sub.on_device = False
            self.device_delta -= sub.h2d_bytes
        sub.device = sub.inputs = None

    def drop(self, i: int) -> None:
        sub = self.subs[i]
        self.off_device(sub)
        if sub.res is not None:
            sub.res.close()
        sub.res = sub.ring_out = sub.dest = None
        sub.spans = []

    def release(self) -> None:
        """After a failure, once its streams have drained: let go of every buffer this
        partition holds (its sub-chunks', its joined inputs, its output), so that nothing
        that still refers to it (a traceback's frames, the closures they ran) keeps them."""
        for i in range(len(self.subs)):
            self.drop(i)
        self.args = []
        self.admission.inputs = {}
        self.output.array = None

    def settle(self, failed: bool, max_window: int, amounts: dict[str, float]) -> None:
        """This partition's tallies into the runtime's counters, in one locked update,
        plus what the driver adds in ``amounts`` (counters other than the tally's own,
        which it would replace); fallbacks to the meter."""
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

    def timed(self, i: int) -> bool:
        """Whether sub-chunk ``i``'s device stages are timed on the device: always, unless
        the backend's marks are dear (then now and then only, see ``sampling``; its stages
        are estimated otherwise)."""
        sampler = self.rt.sampler
        if sampler is None:
            return True
        nbytes = self.subs[i].h2d_bytes
        return sampler.due(self.spec.key[0], nbytes, time.monotonic(), self.lay.cut)
