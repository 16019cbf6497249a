"""A partition's sub-chunks: what each holds while it runs, and its way into the ring.

:class:`SubChunk` is one sub-chunk's buffers and timings (see ``partition``'s module
docstring for who holds what, and until when). :class:`Admission` plans them: which
inputs go through the pinned ring and which are copied from directly, which sub-chunks
are small enough to skip the ring altogether (``overlap.direct-bytes``), and, before the
engine lets one start, the ring room it reserves for its staged inputs and its result.
"""

from __future__ import annotations

from typing import Any

from ..backends.base import Backend
from .engine import Stage
from .layout import Layout
from .runtime import EVERY_SUB_CHUNK

__all__ = ["Admission", "SubChunk"]


class SubChunk:
    """One sub-chunk's buffers and timings, from its planning until it is let go."""

    __slots__ = (
        "d2h_bytes",
        "dest",
        "direct",
        "fallbacks",
        "device",
        "h2d_bytes",
        "inputs",
        "marks",
        "need",
        "on_device",
        "res",
        "ring_out",
        "spans",
        "stage_now",
        "stream",
        "to_stage",
    )

    def __init__(self, inputs: list[Any], to_stage: list[bool], h2d_bytes: int):
        self.inputs = inputs
        self.to_stage = to_stage
        self.h2d_bytes = h2d_bytes
        self.d2h_bytes = 0
        self.fallbacks = 0  # buffers that went through pageable memory (no ring room)
        self.res: Any = None  # the ring reservation
        self.ring_out: Any = None  # the result's copy in the ring, until unstaged
        self.dest: Any = None  # where unstaging puts it
        self.device: Any = None  # device inputs and result, until the D2H completed
        self.stream: Any = None
        self.marks: list[Any] = []
        self.spans: list[tuple[str, float, float, int]] = []
        self.stage_now = Stage.H2D  # the device stage it is in (named by its error)
        self.on_device = False  # counted in device_bytes_in_flight
        self.need: int | None = None  # ring bytes it reserves, worked out once
        self.direct = False  # small enough to skip the ring (the direct-bytes option)


class Admission:
    """Plans a partition's sub-chunks and admits them into the pinned ring.

    Parameters
    ----------
    backend
        The runtime's backend (its pinned pool is the ring).
    direct_bytes
        ``overlap.direct-bytes`` as the runtime resolved it: a sub-chunk moving at most
        this much, in and out, skips the ring; every one does with
        :data:`EVERY_SUB_CHUNK`.
    lay, inputs
        The partition's layout and its inputs (:class:`~.inputs.Input`, by argument
        position).
    out, out_shape, out_dtype
        The partition spec's ``out`` mode and what the output declares for this block.
    """

    __slots__ = (
        "backend",
        "inputs",
        "direct_bytes",
        "lay",
        "out",
        "out_dtype",
        "out_shape",
        "pool",
        "ring_full",
        "waiting_for",
    )

    def __init__(
        self,
        backend: Backend,
        direct_bytes: int,
        lay: Layout,
        inputs: dict[int, Any],
        out: str,
        out_shape: tuple | None,
        out_dtype: Any,
    ):
        self.backend = backend
        self.pool = backend.pinned
        self.direct_bytes = direct_bytes
        self.lay = lay
        self.inputs = inputs
        self.out = out
        self.out_shape = out_shape
        self.out_dtype = out_dtype
        self.waiting_for = 0  # ring bytes the next sub-chunk waits for, while refused
        self.ring_full = 0  # admissions refused for want of room

    def sub_chunk(self, i: int) -> SubChunk:
        """Sub-chunk ``i``: its inputs, and which of them go through the ring."""
        inputs = self.lay.inputs(self.inputs, i)
        h2d = sum(x.nbytes for x in inputs if not x.on_device)  # bytes copied in
        if self._direct(i, h2d):
            sub = SubChunk(inputs, [False] * len(inputs), h2d)
            sub.need, sub.direct = 0, True
            return sub
        # (Whether an input is pinned is asked only here: a driver call on CUDA.)
        return SubChunk(inputs, [x.needs_staging for x in inputs], h2d)

    def _direct(self, i: int, h2d: int) -> bool:
        """Whether sub-chunk ``i``, with ``h2d`` bytes in, is small enough to skip the ring
        (the ``direct-bytes`` option: so small a copy costs less than staging it would); an
        output of unknown size counts as large."""
        if self.direct_bytes == EVERY_SUB_CHUNK:
            return True
        if h2d > self.direct_bytes:
            return False
        if self.out == "device":
            return True  # nothing comes back
        out = self.lay.expected_out_bytes(i, self.out_shape, self.out_dtype)
        return out is not None and h2d + out <= self.direct_bytes

    def _need(self, i: int, sub: SubChunk) -> int:
        """Ring bytes sub-chunk ``i`` reserves: its staged inputs and its copied-out result
        (asked again after every refused admission, so worked out once)."""
        if sub.need is not None:
            return sub.need
        charge = self.pool.charge
        need = 0
        for x, staged in zip(sub.inputs, sub.to_stage, strict=True):
            if staged:
                need += charge(x.nbytes)
        if self.out == "host":  # ("pinned" results go to a block of their own)
            out = self.lay.expected_out_bytes(i, self.out_shape, self.out_dtype)
            # Unknown (an extent Dask does not know): as many bytes as came in.
            out = sub.h2d_bytes if out is None else out
            need += charge(out) if out else 0
        sub.need = need
        return need

    def admit(self, i: int, sub: SubChunk) -> bool:
        """May sub-chunk ``i`` start now? Reserves its ring room (on ``sub.res``)."""
        need = self._need(i, sub)
        if need == 0:
            return True
        res = self.pool.reserve(need)
        if res is None and need <= self.pool.ring_limit:
            self.waiting_for = need  # it will fit once others give room back: wait for it
            self.ring_full += 1
            return False
        # Larger than the ring is sure to have: taken when there is room, else it runs
        # through pageable memory (counted), rather than wait for what may never come.
        sub.res = res
        return True
