"""The program of a fused partition: several steps of a pipeline, run on the device in one
partition, one copy in and one copy out.

A partition task runs ``func`` on each sub-chunk's device arrays. When the graph's fusion
(:mod:`dask_overlap.graph.fusion`) gives one partition the work of its neighbours, its
``func`` is a :class:`Program`: steps that prepare an input (``before``: an elementwise
Dask step that fed the partition), the partition's own function (``first``), and steps
that take the result on (``then``: another ``dask_overlap.map_blocks`` stage, Dask's
elementwise steps, the first step of a reduction). Each step runs on the device arrays
as they are, so an intermediate never leaves the device.

A step is either a function called with the value and constants (:class:`Call`) or a
Dask task template, which Dask itself evaluates with the value in place of the block it
stood for (:class:`Template`). A step that raises keeps its error's type, with a note
naming the step. In a partition that joined several blocks (``batch="auto"``), a step that
must see each block as Dask would have given it runs on each block's piece of the batch
(:class:`EachBlock`, bound to the batch's blocks by :meth:`Program.at`), and the result is
then one a block (see :mod:`.blocks`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from dask.utils import funcname

from ..backends import tokenize_kept
from .blocks import PerBlock, cut, foldable, folded, pieces, unfolded

__all__ = ["EACH_BLOCK_MODES", "PREVIOUS", "Call", "EachBlock", "Program", "Template"]


class _Previous:
    """Stands for the value the step before made (picklable: one per process)."""

    def __reduce__(self) -> str:
        return "PREVIOUS"

    def __repr__(self) -> str:
        return "PREVIOUS"


PREVIOUS = _Previous()


class Call:
    """``fn(*args, **kwargs)``, with :data:`PREVIOUS` in ``args`` replaced by the value;
    ``name`` is the layer it was (the ``map_blocks`` call's output)."""

    __slots__ = ("args", "fn", "kwargs", "name")

    def __init__(self, name: str, fn: Callable[..., Any], args: tuple, kwargs: Mapping):
        self.name, self.fn, self.args, self.kwargs = name, fn, tuple(args), dict(kwargs)

    @property
    def label(self) -> str:
        return funcname(self.fn)

    def __call__(self, value: Any) -> Any:
        args = [value if a is PREVIOUS else a for a in self.args]
        return self.fn(*args, **self.kwargs)

    def __reduce__(self) -> tuple:
        return Call, (self.name, self.fn, self.args, self.kwargs)

    def __dask_tokenize__(self) -> Any:
        return ("Call", self.name, tokenize_kept(self.fn), self.args, self.kwargs)


class Template:
    """A Dask task template (a ``Blockwise`` layer's ``task``), evaluated with the value
    as the block ``token`` stands for and ``constants`` for the others; ``name`` is the
    layer it was."""

    __slots__ = ("constants", "name", "task", "token")

    def __init__(self, name: str, task: Any, token: str, constants: Mapping[str, Any]):
        self.name, self.task, self.token, self.constants = name, task, token, dict(constants)

    @property
    def label(self) -> str:
        return funcname(self.task.func)

    def __call__(self, value: Any) -> Any:
        values = dict(self.constants)
        values[self.token] = value
        return self.task(values)

    def __reduce__(self) -> tuple:
        return Template, (self.name, self.task, self.token, self.constants)

    def __dask_tokenize__(self) -> Any:
        return ("Template", self.name, tokenize_kept(self.task), self.token, self.constants)


#: How an :class:`EachBlock` step may run in fewer calls than one a block: ``"batch"``, a
#: reduction over other axes than the batch's, once on the batch, its partial cut into the
#: blocks' (a dict partial: it cannot be cut as a block); ``"fold"``, a reduction along
#: the batch's axis, once on the blocks folded into a new last axis (``blocks.folded``),
#: where that reduces each as it would be alone (``blocks.foldable``). Otherwise, and
#: where the partial does not come out so, once a block (``"each"``).
EACH_BLOCK_MODES = ("each", "batch", "fold")


class EachBlock:
    """``step`` run on each block's piece of a batch's output, cut along ``axis`` into the
    blocks' ``extents`` (a partition's own: unbound, ``None``, until :meth:`at`); its value
    is their results, one a block (:class:`~.blocks.PerBlock`). ``how``: one of
    :data:`EACH_BLOCK_MODES`."""

    __slots__ = ("axis", "extents", "how", "step")

    def __init__(
        self,
        step: Call | Template,
        axis: int,
        extents: tuple[int, ...] | None = None,
        how: str = "each",
    ):
        if how not in EACH_BLOCK_MODES:
            raise ValueError(f"how must be one of {EACH_BLOCK_MODES}, got {how!r}")
        self.step, self.axis, self.extents, self.how = step, axis, extents, how

    @property
    def name(self) -> str:
        return self.step.name

    @property
    def label(self) -> str:
        return self.step.label

    def at(self, extents: tuple[int, ...]) -> EachBlock:
        """The same step, for a batch of blocks of ``extents`` along its axis."""
        return EachBlock(self.step, self.axis, extents, self.how)

    def __call__(self, value: Any) -> PerBlock:
        extents, axis = self.extents, self.axis
        if extents is None:  # pragma: no cover - a partition task binds it (task.py)
            raise RuntimeError(f"{self.label}: run on each block of a batch not said")
        results = None
        if self.how == "batch":
            results = cut(self.step(value), axis, extents)
        elif self.how == "fold" and foldable(value, axis, extents):
            results = unfolded(self.step(folded(value, axis, extents)), value.ndim, len(extents))
        if results is None:
            parts = pieces(value, axis, extents, self.label)
            results = [self.step(part) for part in parts]
        return PerBlock(results, axis)

    def __reduce__(self) -> tuple:
        return EachBlock, (self.step, self.axis, self.extents, self.how)

    def __dask_tokenize__(self) -> Any:
        return ("EachBlock", self.step, self.axis, self.extents, self.how)


Step = Call | Template | EachBlock


class Program:
    """``func`` of a fused partition (see the module docstring).

    Parameters
    ----------
    first
        The partition's own function, called with the partition's arguments.
    before
        ``(position, step)``: a step applied to argument ``position`` first.
    then
        The steps that take the result on, in order.
    """

    __slots__ = ("before", "first", "then")

    def __init__(
        self,
        first: Callable[..., Any],
        before: tuple[tuple[int, Step], ...] = (),
        then: tuple[Step, ...] = (),
    ):
        self.first, self.before, self.then = first, tuple(before), tuple(then)

    @property
    def names(self) -> list[str]:
        """Every step's function's name, in the order they run."""
        first = self.first.names if isinstance(self.first, Program) else [funcname(self.first)]
        return [s.label for _, s in self.before] + first + [s.label for s in self.then]

    @property
    def per_block(self) -> list[EachBlock]:
        """The steps whose results are one a block of a batch (:class:`EachBlock`)."""
        return [s for s in self.then if isinstance(s, EachBlock)]

    def at(self, extents: tuple[int, ...]) -> Program:
        """This program for a batch of blocks of ``extents`` along the axis its
        :class:`EachBlock` steps cut (itself where it has none)."""
        if not any(isinstance(s, EachBlock) for s in self.then):
            return self
        then = tuple(s.at(extents) if isinstance(s, EachBlock) else s for s in self.then)
        return Program(self.first, self.before, then)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        n, i = len(self.names), 0
        if self.before:
            args = list(args)
            for position, step in self.before:
                i += 1
                args[position] = _noted(step, args[position], i, n)
        i += 1
        try:
            value = self.first(*args, **kwargs)
        except Exception as e:
            e.add_note(f"dask_overlap: fused step {i} of {n}: {funcname(self.first)}")
            raise
        for step in self.then:
            i += 1
            value = _noted(step, value, i, n)
        return value

    def __reduce__(self) -> tuple:
        return Program, (self.first, self.before, self.then)

    def __dask_tokenize__(self) -> Any:
        return ("Program", tokenize_kept(self.first), self.before, self.then)

    def __repr__(self) -> str:
        return f"Program({' -> '.join(self.names)})"


def _noted(step: Step, value: Any, i: int, n: int) -> Any:
    """``step(value)``; an error keeps its type, with a note naming the step."""
    try:
        return step(value)
    except Exception as e:
        e.add_note(f"dask_overlap: fused step {i} of {n}: {step.label} ({step.name})")
        raise
