"""The partition task: the callable Dask runs for each partition, on a worker.

It is built on the client by ``map_blocks`` (:mod:`dask_overlap.graph`), travels pickled
with every partition, and runs the partition through the runtime that serves its
process (:func:`~dask_overlap.pipeline.current.get_runtime`). What it knows of the output
array (its name, its chunks, its dtype) is given when it is made, so that every partition
can check what ``func`` returns against what the array declares.
"""

from __future__ import annotations

import copy
import math
import pickle
import sys
from collections.abc import Callable
from typing import Any

import cloudpickle
import numpy as np
from dask.utils import funcname

from ..backends import kernels_kept, tokenize_kept
from .blocks import BatchBlocks
from .current import get_runtime
from .partition import PartitionSpec, run_partition
from .program import Call, EachBlock, Program
from .stats import Retired
from .store import Store

__all__ = ["PartitionTask", "PartitionTaskWithInfo", "axis_extents", "block_shape"]

# The task travels pickled with every partition, so what it knows of the output's chunks
# must not grow with their number: a regular axis is three numbers, an irregular one is
# kept up to this many blocks (past it, its extents go unchecked).
_MAX_IRREGULAR_BLOCKS = 1024


def axis_extents(chunks: tuple[float, ...]) -> tuple | None:
    """One output axis's chunks, as the task carries them (see :func:`block_shape`)."""
    known = not any(math.isnan(c) for c in chunks)
    if known and len(chunks) > 1 and len(set(chunks[:-1])) == 1:
        return ("regular", int(chunks[0]), int(chunks[-1]), len(chunks))
    if len(chunks) <= _MAX_IRREGULAR_BLOCKS:
        return ("each", tuple(chunks))
    return None


def block_shape(axes: tuple[tuple | None, ...], block_id: tuple[int, ...]) -> tuple:
    """Block ``block_id``'s shape from its axes as the task carries them (see
    :func:`axis_extents`); ``None`` for an extent not known (Dask's nan, or an irregular
    axis of too many blocks). One loop: it runs for every partition."""
    shape = []
    for axis, i in zip(axes, block_id, strict=True):
        if axis is None:
            shape.append(None)
        elif axis[0] == "regular":
            shape.append(axis[2] if i == axis[3] - 1 else axis[1])
        else:
            c = axis[1][i]
            shape.append(None if math.isnan(c) else int(c))
    return tuple(shape)


class PartitionTask:
    """The callable Dask runs for each partition (picklable; tokenized by content)."""

    def __init__(
        self,
        func: Callable[..., Any],
        *,
        backend: str,
        array_positions: tuple[int, ...],
        ndim: int,
        split_axis: int | None,
        out_split_axis: int | None,
        sub_chunk_bytes: int | str | None,
        in_flight: int | None,
        func_block_id: bool,
        func_block_info: bool,
        out_mode: str = "host",
        batch: int = 1,
        enforce_ndim: bool = False,
    ):
        self.func = func
        self.out_mode = out_mode  # one of OUT_MODES: where each output block is left
        self.batch = batch  # blocks along split_axis a partition joins (for errors)
        # Dask's enforce_ndim as the call gave it. Every partition checks its output's shape
        # either way; it is in the token so that the array's name differs as Dask's does.
        self.enforce_ndim = enforce_ndim
        self.backend = backend
        self.array_positions = array_positions
        self.ndim = ndim
        self.split_axis = split_axis
        self.out_split_axis = out_split_axis
        self.sub_chunk_bytes = sub_chunk_bytes
        self.in_flight = in_flight
        self.func_block_id = func_block_id
        self.func_block_info = func_block_info
        # What the output array declares (see declared): the key name is the output's name
        # (each partition's key starts with it); func's own name stands in until then.
        self.key_name = funcname(func)
        self.out_chunks: tuple[tuple | None, ...] | None = None  # per axis: see axis_extents
        self.out_dtype: np.dtype | None = None
        self.store: Store | None = None  # a fused store after the steps (see .store)
        # A batch's blocks, where the partition's result is one a block (see .blocks).
        self.blocks: BatchBlocks | None = None

    def declared(
        self, name: str, chunks: tuple[tuple[float, ...], ...], dtype: Any
    ) -> PartitionTask:
        """A copy of this task that knows the array built around it: its ``name`` (each
        partition's key starts with it), its ``chunks`` and its ``dtype``, against which
        every partition checks what ``func`` returns. This task is left as it is."""
        task = copy.copy(self)
        task.key_name = name
        task.out_chunks = tuple(axis_extents(c) for c in chunks)
        task.out_dtype = np.dtype(dtype) if dtype is not None else None
        return task

    def absorbed(
        self,
        step: Any,
        then: PartitionTask | None,
        whole: bool,
        dtype: Any = None,
        reduces: tuple[int, ...] = (),
        shaped: bool = True,
    ) -> PartitionTask:
        """A copy of this task whose ``func`` goes on with ``step`` (see
        :mod:`.program`): the partition of another stage (``then``: its name, output and
        options are the copy's), or a Dask step, whose output has ``dtype`` (``None``: not
        known) and, for the first step of a reduction over the axes ``reduces``, one
        element along each of them; ``shaped``: the blocks' shape after it is known so
        (false: the step may change it, and it goes unchecked). ``whole``: the copy runs
        whole partitions (its steps cannot be cut into sub-chunks)."""
        task = copy.copy(self)
        program = self.func if isinstance(self.func, Program) else Program(self.func)
        steps = (step,)
        inner = getattr(step, "fn", None)
        if isinstance(inner, Program) and not inner.before:
            # A stage fused with its own followers first: its steps, spliced in (one
            # program, whose steps explain() and an error's note count and name).
            steps = (Call(step.name, inner.first, step.args, step.kwargs), *inner.then)
        task.func = Program(program.first, program.before, (*program.then, *steps))
        task.key_name = step.name
        if then is not None:
            task.out_mode = then.out_mode
            task.out_chunks, task.out_dtype = then.out_chunks, then.out_dtype
            task.out_split_axis = then.out_split_axis
        else:
            task.out_dtype = None if dtype is None else np.dtype(dtype)
            if not shaped and task.out_chunks is not None:
                task.out_chunks = (None,) * len(task.out_chunks)
            elif reduces and task.out_chunks is not None:
                task.out_chunks = tuple(
                    _one_each(axis) if i in reduces else axis
                    for i, axis in enumerate(task.out_chunks)
                )
        if whole:
            task.split_axis = task.out_split_axis = None
        return task

    def each_block(self, step: Any, blocks: BatchBlocks, how: str = "each") -> PartitionTask:
        """A copy of this task (a batch of ``blocks``) whose ``func`` goes on with ``step``
        run on each block's piece of the batch (:class:`~.program.EachBlock`, ``how`` one
        of its modes): its result is then one a block, a tuple (see :mod:`.blocks`), with
        no shape or dtype of its own to check, and it runs whole partitions."""
        task = self.absorbed(EachBlock(step, blocks.axis, None, how), None, True)
        task.out_chunks, task.blocks = None, blocks
        return task

    def each_stored(self, store: Store, name: str, blocks: BatchBlocks) -> PartitionTask:
        """A copy of this task (a batch of ``blocks``) that writes its batch as ``store``
        says (see :meth:`stored`), then returns what Dask's store step returns for each
        of its blocks, a tuple."""
        task = self.stored(store, name)
        task.blocks = blocks
        return task

    def preceded(self, position: int, step: Any, whole: bool = False) -> PartitionTask:
        """A copy of this task whose ``func`` first applies ``step`` (a Dask step, see
        :mod:`.program`) to its argument ``position``; ``whole``: the copy runs whole
        partitions (``step`` cannot be cut into sub-chunks)."""
        task = copy.copy(self)
        if whole:
            task.split_axis = task.out_split_axis = None
        program = self.func if isinstance(self.func, Program) else Program(self.func)
        before = ((position, step), *program.before)  # the new step is the earliest
        task.func = Program(program.first, before, program.then)
        return task

    def stored(self, store: Store, name: str) -> PartitionTask:
        """A copy of this task that writes each partition's result as ``store`` says into
        the target it gets as its last argument (Dask's ``load_store_chunk`` after it,
        fused), its keys named ``name``."""
        task = copy.copy(self)
        task.store, task.key_name = store, name
        if task.out_mode == "pinned":  # the result lives in the target, not in the pool
            task.out_mode = "host"
        return task

    def __copy__(self) -> PartitionTask:
        # Not through __reduce_ex__ below: a copy shares func as it is.
        task = type(self).__new__(type(self))
        task.__dict__.update(self.__dict__)
        return task

    def __reduce_ex__(self, protocol: Any) -> Any:
        # func may close over a CuPy kernel that a copy unpickled in this process would
        # break (an in-process cluster unpickles what the client pickled): the task's
        # state is pickled with kernels as references (see
        # dask_overlap.backends.kernel_pickling); as any object where there is no CuPy.
        if "cupy" not in sys.modules:
            return super().__reduce_ex__(protocol)
        with kernels_kept():
            return _task_from_state, (type(self), cloudpickle.dumps(self.__dict__))

    def __dask_tokenize__(self) -> Any:
        return (
            type(self).__name__,
            tokenize_kept(self.func),  # (tokenize loads what it pickles: see __reduce_ex__)
            self.enforce_ndim,
            self.backend,
            self.array_positions,
            self.split_axis,
            self.out_split_axis,
            self.sub_chunk_bytes,
            self.in_flight,
            self.out_mode,
            self.batch,
            self.store is not None,
            self.blocks,
        )

    def _run(self, args: tuple, block_id: tuple | None, block_info: dict | None, kwargs: dict):
        if self.func_block_id:
            kwargs = dict(kwargs, block_id=block_id)
        out_shape = into = index = None
        if self.out_chunks is not None and block_id is not None:
            out_shape = block_shape(self.out_chunks, block_id)
        store, target = self.store, None
        if store is not None:  # its target is the last argument (see .store)
            *args, target = args
            index = store.index(self.out_chunks, block_id or ())
            into = store.into(target, index)
        func, blocks, extents = self.func, self.blocks, None
        if blocks is not None:  # a batch whose result is one a block: which blocks
            extents = blocks.of((block_id or ())[blocks.axis])
            if isinstance(func, Program):
                func = func.at(extents)
        # In the fields' order, not by keyword: twelve keywords cost a dataclass's
        # __init__ more than the rest of the spec does, and this runs per partition.
        spec = PartitionSpec(
            (self.key_name, *(block_id or ())),  # key
            self.array_positions,
            self.ndim,
            self.split_axis,
            self.out_split_axis,
            self.sub_chunk_bytes,
            self.in_flight,
            block_info,
            self.key_name,  # func_name
            out_shape,
            self.out_dtype,
            self.out_mode,  # out
            self.batch,
            into,
        )
        retired = None
        while True:
            rt = get_runtime(self.backend)
            if rt is retired:  # (no lookup hands out a closed runtime twice)
                raise RuntimeError(f"dask_overlap: {rt.name} runtime closed under this task")
            try:
                result = run_partition(rt, func, args, kwargs, spec)
                break
            except Retired:  # retired or closed between the lookup and the start: again
                retired = rt
        if store is None:
            return result
        if blocks is not None:
            indexes = store.indexes(self.out_chunks, block_id, blocks.axis, extents)
            return store.finish_each(result, target, into, indexes, blocks.axis, extents)
        return store.finish(result, target, into, index)

    def __call__(self, *args: Any, block_id: tuple | None = None, **kwargs: Any) -> Any:
        return self._run(args, block_id, None, kwargs)


def _task_from_state(cls: type[PartitionTask], state: bytes) -> PartitionTask:
    """A partition task from :meth:`PartitionTask.__reduce_ex__`'s pickled state."""
    task = cls.__new__(cls)
    task.__dict__.update(pickle.loads(state))
    return task


def _one_each(axis: tuple | None) -> tuple | None:
    """An output axis as :func:`axis_extents` carries it, reduced to one element a block."""
    if axis is None:
        return None
    blocks = axis[3] if axis[0] == "regular" else len(axis[1])
    return ("regular", 1, 1, blocks)


class PartitionTaskWithInfo(PartitionTask):
    """The same, for a ``func`` that asks for ``block_info`` (Dask then builds it)."""

    def __call__(
        self,
        *args: Any,
        block_id: tuple | None = None,
        block_info: dict | None = None,
        **kwargs: Any,
    ) -> Any:
        return self._run(args, block_id, block_info, kwargs)
