"""Fusion: a stage, Dask's elementwise steps and a reduction's first step, taken into the
partition before them (graph/fusion.py), on the host backend."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import dask
import dask.array as da
import numpy as np
import pytest
from distributed import Client
from support import wait_until_idle

import dask_overlap
from dask_overlap import LocalGPUCluster
from dask_overlap.graph.batch import CutBack
from dask_overlap.pipeline.blocks import PerBlock
from dask_overlap.pipeline.program import PREVIOUS, Call, EachBlock


def data() -> tuple[np.ndarray, da.Array]:
    a = np.random.default_rng(0).standard_normal((256, 24))
    return a, da.from_array(a, chunks=(64, 24))


def stage(fn: Any, x: da.Array, **kw: Any) -> da.Array:
    return dask_overlap.map_blocks(fn, x, split_axis=0, batch=1, **kw)


def steps(collection: Any) -> list[list[str]]:
    """Each partition layer's steps, as :func:`dask_overlap.explain` says them."""
    out = []
    for line in dask_overlap.explain(collection).splitlines():
        found = re.search(r"partitions of (.*?)( \(fused|$)", line)
        out.append(found.group(1).split(" -> "))
    return out


def double(b: Any) -> Any:
    return b * 2


def row_sums(b: Any) -> Any:
    return b.sum(axis=1)


def test_two_stages_run_as_one_partition_a_block():
    a, x = data()
    z = stage(np.abs, stage(double, x))
    assert steps(z) == [["double", "absolute"]]
    np.testing.assert_array_equal(z.compute(), np.abs(a * 2))
    stats = wait_until_idle()
    assert stats["partitions"] == x.npartitions  # not two a block
    assert stats["bytes_h2d"] == a.nbytes  # handed to the partition once


def test_the_intermediate_is_no_key_of_the_graph_that_runs():
    _, x = data()
    y = stage(double, x)
    z = stage(np.abs, y)
    (opt,) = dask.optimize(z)
    names = {k[0] for k in dict(opt.__dask_graph__()) if isinstance(k, tuple)}
    assert y.name not in names and z.name in names


@pytest.mark.parametrize(
    "build, expected",
    [
        (lambda y: y * 2 + 1, ["double", "mul", "add"]),
        (lambda y: da.sqrt(abs(y)), ["double", "abs", "sqrt"]),
        (lambda y: y.astype("f4"), ["double", "astype"]),
        (lambda y: -y, ["double", "neg"]),
        (lambda y: y.clip(-1, 1), ["double", "clip"]),
        (lambda y: (y > 0) & (y < 1), None),  # reads two arrays in the last step
    ],
    ids=["mul-add", "sqrt-abs", "astype", "neg", "clip", "two-inputs"],
)
def test_elementwise_steps_after_a_stage(build, expected):
    a, x = data()
    z = build(stage(double, x))
    if expected is not None:
        assert steps(z)[-1] == expected
    plain = build(x.map_blocks(double))
    got = z.compute()
    np.testing.assert_allclose(got, plain.compute())
    assert got.dtype == plain.dtype


@pytest.mark.parametrize(
    "build, expected",
    [
        (lambda x: x * 2 + 1, ["mul", "add", "double"]),
        (lambda x: da.sqrt(abs(x)), ["abs", "sqrt", "double"]),
        (lambda x: x.astype("f4"), ["astype", "double"]),
        (lambda x: da.where(x > 0, x, 0), None),  # the last step reads two arrays
        (lambda x: x.map_blocks(lambda b: b + 1), None),  # a function of the user's
    ],
    ids=["mul-add", "sqrt-abs", "astype", "two-inputs", "users-function"],
)
def test_elementwise_steps_before_a_stage(build, expected):
    a, x = data()
    z = stage(double, build(x))
    if expected is not None:
        assert steps(z) == [expected]
        assert stage(double, x).npartitions == x.npartitions
    else:
        assert steps(z)[-1][-1:] == ["double"] and len(steps(z)[-1]) == 1
    got = z.compute()
    plain = build(x).map_blocks(double)
    np.testing.assert_allclose(got, plain.compute())
    assert got.dtype == plain.dtype
    if expected is not None:
        stats = wait_until_idle()
        assert stats["partitions"] == x.npartitions
        assert stats["bytes_h2d"] == a.nbytes  # x's blocks handed in, not the step's


def one_d() -> tuple[np.ndarray, da.Array]:
    a = np.random.default_rng(2).standard_normal(4096)
    return a, da.from_array(a, chunks=1024)


@pytest.mark.parametrize("fn", [np.sort, np.cumsum], ids=["sort", "cumsum"])
def test_a_step_that_is_not_elementwise_before_a_stage_runs_on_whole_blocks(fn):
    a, x = one_d()
    z = stage(double, x.map_blocks(fn), sub_chunk_bytes=1024)  # 8 sub-chunks a block
    assert steps(z) == [[fn.__name__, "double"]]
    assert "whole partitions" in dask_overlap.explain(z)
    np.testing.assert_array_equal(z.compute(), x.map_blocks(fn).compute() * 2)


@pytest.mark.parametrize("fn", [np.sort, np.cumsum], ids=["sort", "cumsum"])
def test_a_step_that_is_not_elementwise_after_a_stage_runs_on_whole_blocks(fn):
    a, x = one_d()
    z = stage(double, x, sub_chunk_bytes=1024).map_blocks(fn)
    assert steps(z) == [["double", fn.__name__]]
    assert "whole partitions" in dask_overlap.explain(z)
    np.testing.assert_array_equal(z.compute(), x.map_blocks(fn).compute() * 2)


@pytest.mark.parametrize(
    "build, label",
    [
        (lambda y: y.map_blocks(np.cumsum, axis=0), "cumsum"),
        (lambda y: y.map_blocks(np.flip, axis=1), "flip"),
        (lambda y: y.map_blocks(np.diff, axis=0, chunks=((63,) * 4, (24,))), "diff"),
        (lambda y: da.cumsum(y, axis=1), "cumsum"),
    ],
    ids=["cumsum", "flip", "diff-shorter", "da-cumsum"],
)
def test_a_step_that_takes_an_axis_but_reduces_nothing_keeps_its_blocks_shape(build, label):
    # Only a reduction's first step (axis= and keepdims=True) makes a block one element
    # along its axes; np.diff's blocks are as its chunks= says, which no layer tells.
    a, x = data()
    z = build(stage(double, x))
    assert steps(z)[0] == ["double", label]
    want = build(x.map_blocks(double))
    got = z.compute()
    assert got.shape == want.shape
    np.testing.assert_array_equal(got, want.compute())


def test_a_step_before_a_stage_read_by_something_else_too_is_left_as_it_is():
    a, x = data()
    y = x * 2
    z = stage(double, y) + y
    assert steps(z) == [["double"]]  # (and the add reads two arrays)
    np.testing.assert_allclose(z.compute(), a * 4 + a * 2)


def test_a_step_before_a_stage_with_other_annotations_is_left_as_it_is():
    a, x = data()
    with dask.annotate(priority=5):
        y = x * 2
    z = stage(double, y)
    assert steps(z) == [["double"]]
    np.testing.assert_allclose(z.compute(), a * 4)


def test_a_step_before_a_stage_that_raises_is_named():
    bad = stage(double, da.from_array(np.array(["a", "b"] * 4), chunks=2).astype("f8"))
    with pytest.raises(ValueError) as info:
        bad.compute()
    notes = "\n".join(getattr(info.value, "__notes__", []))
    assert "fused step 1 of 2: astype" in notes


REDUCTIONS = ["sum", "prod", "min", "max", "mean", "var", "std", "nansum", "nanmean", "nanmax"]


@pytest.mark.parametrize("how", REDUCTIONS)
@pytest.mark.parametrize("axis", [None, 0, 1, (0, 1)], ids=["all", "0", "1", "both"])
@pytest.mark.parametrize("keepdims", [False, True], ids=["", "keepdims"])
def test_reductions_take_their_first_step_in_the_partition(how, axis, keepdims):
    a, x = data()
    small = stage(lambda b: b * 0.5, x)  # values where prod stays finite
    z = getattr(da, how)(small, axis=axis, keepdims=keepdims)
    chain = steps(z)
    assert len(chain) == 1 and len(chain[0]) == 2, dask_overlap.explain(z)
    expected = getattr(np, how)(a * 0.5, axis=axis, keepdims=keepdims)
    np.testing.assert_allclose(z.compute(), expected, rtol=1e-10)


@pytest.mark.parametrize("how", ["any", "all"])
def test_boolean_reductions_after_a_comparison(how):
    a, x = data()
    z = getattr(stage(double, x) > 0, how)(axis=0)
    assert steps(z) == [["double", "gt", how]]
    np.testing.assert_array_equal(z.compute(), getattr(a * 2 > 0, how)(axis=0))


def test_a_reduction_with_a_dtype():
    a, x = data()
    z = stage(double, x).astype("f4").sum(axis=1, dtype="f8")
    np.testing.assert_allclose(z.compute(), (a * 2).astype("f4").sum(axis=1, dtype="f8"))
    assert z.dtype == np.float64


def test_a_reduction_makes_the_partition_whole():
    _, x = data()
    assert "whole partitions" in dask_overlap.explain(stage(double, x, sub_chunk_bytes=1024).sum())


def test_stages_of_other_split_axes_run_whole_partitions():
    a, x = data()
    y = dask_overlap.map_blocks(double, x, split_axis=0, batch=1, sub_chunk_bytes=1024)
    z = dask_overlap.map_blocks(np.abs, y, split_axis=1, batch=1)
    assert "whole partitions" in dask_overlap.explain(z)
    np.testing.assert_array_equal(z.compute(), np.abs(a * 2))


def test_stages_that_share_the_split_axis_stay_pipelined():
    a, x = data()
    z = stage(np.abs, stage(double, x, sub_chunk_bytes=2048))
    assert "whole" not in dask_overlap.explain(z)
    np.testing.assert_array_equal(z.compute(), np.abs(a * 2))
    assert wait_until_idle()["sub_chunks"] > x.npartitions


def add_first(t: Any, b: Any) -> Any:
    return b + t[0]


@pytest.mark.parametrize(
    "constant",
    [(100.0, 200.0), np.array([100.0, 200.0])],
    ids=["tuple", "ndarray"],
)
def test_constants_of_a_stage_stay_where_they_are_given(constant):
    # A tuple was taken for the names of the keywords Dask passes (dropped: the step
    # before ran on it), and an ndarray compared with a layer's name (ambiguous truth).
    a, x = data()
    before = dask_overlap.map_blocks(add_first, constant, x * 2, split_axis=0, batch=1)
    assert steps(before) == [["mul", "add_first"]]
    np.testing.assert_array_equal(before.compute(), a * 2 + 100)
    after = dask_overlap.map_blocks(
        lambda b, t: b - t[1], stage(double, x), constant, split_axis=0, batch=1
    )
    assert [len(s) for s in steps(after)] == [2]
    np.testing.assert_array_equal(after.compute(), a * 2 - 200)


def test_a_step_called_as_a_reduction_that_keeps_more_is_left_to_dask():
    # da.topk's first step is called as a reduction's is (axis=, keepdims=True) but keeps
    # k along the axis: taken in as one, its partition failed its own shape check.
    a, x = data()
    z = da.topk(stage(double, x), 3, axis=0)
    assert steps(z) == [["double"]]
    np.testing.assert_array_equal(z.compute(), np.sort(a * 2, axis=0)[::-1][:3])


# -- what is left as it is -------------------------------------------------------------
def test_an_intermediate_asked_for_is_computed_and_not_fused_away():
    a, x = data()
    y = stage(double, x)
    z = stage(np.abs, y)
    got_y, got_z = dask.compute(y, z)
    np.testing.assert_array_equal(got_y, a * 2)
    np.testing.assert_array_equal(got_z, np.abs(a * 2))


def test_an_intermediate_read_twice_is_left_as_it_is():
    a, x = data()
    y = stage(double, x)
    z = da.where(y > 1, y, 0)  # y read by gt and by where
    assert [len(s) for s in steps(z)] == [1]
    np.testing.assert_array_equal(z.compute(), np.where(a * 2 > 1, a * 2, 0))


def test_a_function_of_dask_map_blocks_after_a_stage_is_left_as_it_is():
    a, x = data()
    z = stage(double, x).map_blocks(lambda b: b + 1)  # any function: not known to run on CuPy
    assert steps(z) == [["double"]]
    np.testing.assert_array_equal(z.compute(), a * 2 + 1)


def test_a_stage_that_asks_which_block_it_has_is_left_as_it_is():
    a, x = data()

    def where(b: Any, block_id: Any = None) -> Any:
        return b + block_id[0]

    z = stage(where, stage(double, x), dtype=x.dtype)
    assert [len(s) for s in steps(z)] == [1, 1]
    expected = a * 2 + np.repeat(np.arange(4), 64)[:, None]
    np.testing.assert_array_equal(z.compute(), expected)


def test_a_users_annotations_keep_layers_apart():
    a, x = data()
    y = stage(double, x)
    with dask.annotate(priority=5):
        z = y + 1
    assert [len(s) for s in steps(z)] == [1]
    np.testing.assert_array_equal(z.compute(), a * 2 + 1)


def test_fusion_off():
    a, x = data()
    with dask.config.set({"overlap.fuse": False}):
        z = stage(np.abs, stage(double, x)) + 1
        assert [len(s) for s in steps(z)] == [1, 1]
        np.testing.assert_array_equal(z.compute(), np.abs(a * 2) + 1)
    assert wait_until_idle()["partitions"] == 2 * x.npartitions


# -- errors ----------------------------------------------------------------------------
class Bad(ValueError):
    pass


def test_a_fused_step_that_raises_is_named_and_keeps_its_type():
    _, x = data()

    def breaks(b: Any) -> Any:
        raise Bad("no good")

    z = stage(breaks, stage(double, x), dtype=x.dtype) + 1
    with pytest.raises(Bad, match="no good") as info:
        z.compute(scheduler="sync")
    notes = "\n".join(info.value.__notes__)
    assert "fused step 2 of 3: breaks" in notes
    assert "partition ('add-" in notes


# -- stores ----------------------------------------------------------------------------------
class Recording(np.ndarray):
    """A NumPy target that counts the writes made through ``target[index] = block``."""

    writes = 0

    def __setitem__(self, index: Any, value: Any) -> None:
        type(self).writes += 1
        super().__setitem__(index, value)


@pytest.fixture
def recording() -> Any:
    Recording.writes = 0
    return Recording


def test_a_store_is_left_to_dask_where_every_partition_runs_on_the_host(recording):
    # There it saves no copy, and would keep each partition's input alive through the
    # write (graph/steps.py, store_of). (The host backend named: also on a GPU machine.)
    a, x = data()
    with dask.config.set({"overlap.backend": "host"}):
        y = stage(double, x)
    target = np.zeros(a.shape).view(recording)
    stored = da.store(y, target, lock=False, compute=False)
    assert steps(stored) == [["double"]]
    stored.compute()
    np.testing.assert_array_equal(np.asarray(target), a * 2)
    assert recording.writes == x.npartitions  # Dask's store step, a block each


@pytest.mark.usefixtures("as_on_a_device")  # (on the host, a store is not taken in)
def test_a_store_after_a_stage_fills_the_target_in_place(recording):
    a, x = data()
    y = stage(double, x, sub_chunk_bytes="2KiB")
    target = np.zeros(a.shape).view(recording)
    stored = da.store(y, target, lock=False, compute=False)
    assert steps(stored) == [["double", "store"]]
    stored.compute()
    np.testing.assert_array_equal(np.asarray(target), a * 2)
    assert recording.writes == 0  # each sub-chunk went into the target's region itself
    stats = wait_until_idle()
    assert stats["partitions"] == x.npartitions and stats["sub_chunks"] > x.npartitions


@pytest.mark.usefixtures("as_on_a_device")  # (on the host, a store is not taken in)
@pytest.mark.parametrize(
    "kwargs", [{"lock": True}, {"regions": (slice(16, 272),)}, {"return_stored": True}]
)
def test_a_fused_store_does_what_dask_store_does(kwargs):
    a, x = data()
    y = stage(double, x)
    shape = (288, 24) if "regions" in kwargs else a.shape
    got, want = np.zeros(shape), np.zeros(shape)
    out = da.store(y, got, **kwargs)
    with dask.config.set({"overlap.fuse": False}):
        expected = da.store(y, want, **kwargs)
    np.testing.assert_array_equal(got, want)
    if kwargs.get("return_stored"):
        np.testing.assert_array_equal(out.compute(), expected.compute())


@pytest.mark.usefixtures("as_on_a_device")  # (on the host, a store is not taken in)
@pytest.mark.parametrize("how", ["strided", "other dtype"])
def test_a_target_that_cannot_be_filled_in_place_is_written_as_dask_writes_it(recording, how):
    a, x = data()
    y = stage(double, x)
    if how == "strided":
        target = np.zeros(a.shape[::-1]).T.view(recording)
    else:
        target = np.zeros(a.shape, "f4").view(recording)
    da.store(y, target, lock=False)
    np.testing.assert_allclose(np.asarray(target), a * 2, rtol=1e-6)
    assert recording.writes == x.npartitions
    assert wait_until_idle()["partitions"] == x.npartitions  # fused all the same


@pytest.mark.usefixtures("as_on_a_device")  # (on the host, a store is not taken in)
@pytest.mark.parametrize("how", ["delayed", "large"])
def test_a_target_in_a_key_of_its_own_is_handed_to_the_partition(recording, how):
    # Dask puts a Delayed target, or a large array, in a key of its own: the fused
    # partitions read it from there, as the store step did (it is not copied into them).
    rows = 256 if how == "delayed" else 8192  # 8192 x 24 float64: 1.5 MiB
    a = np.random.default_rng(2).standard_normal((rows, 24))
    y = stage(double, da.from_array(a, chunks=(rows // 4, 24)))
    target = np.zeros(a.shape).view(recording)
    dest = dask.delayed(lambda: target)() if how == "delayed" else target
    stored = da.store(y, dest, lock=False, compute=False)
    assert steps(stored) == [["double", "store"]]
    assert len(stored.__dask_graph__().layers) == 4  # from_array, the target, y, the store
    stored.compute()
    np.testing.assert_array_equal(np.asarray(target), a * 2)
    assert recording.writes == 0


# -- batch="auto" over small blocks: fusion through its batches ------------------------------
# These tests need batch="auto" to join small blocks into batches, as it does for a GPU: each
# asserts that it did (``joined``), since a test of fusion through a cut-back that is not
# there would test nothing. On the host backend auto keeps one partition a block, so the
# ``auto_joins`` fixture asks for device-like batching (conftest's ``as_on_a_device``).
# What they assert besides holds either way: the steps that explain() names, and results
# equal to Dask's.
@pytest.fixture
def auto_joins(as_on_a_device: None) -> Iterator[None]:
    """batch="auto" joins small blocks, as for a GPU (see the comment above)."""
    yield


def small() -> tuple[np.ndarray, da.Array]:
    a = np.random.default_rng(1).standard_normal((4096, 16))
    return a, da.from_array(a, chunks=(64, 16))  # 64 blocks of 8 KiB


def joined(collection: Any) -> int:
    """How many blocks the batches of ``collection``'s graph join (the first ``batch="auto"``
    cut-back's ``k``, as built, before fusion); fails where there is none."""
    layers = collection.__dask_graph__().layers.values()
    cuts = [layer for layer in layers if isinstance(layer, CutBack)]
    assert cuts and cuts[0].k > 1, "batch='auto' joined no blocks here (see auto_joins)"
    return cuts[0].k


def test_two_auto_stages_over_small_blocks_fuse_through_their_batches(auto_joins):
    a, x = small()
    y = dask_overlap.map_blocks(double, x, split_axis=0)
    z = dask_overlap.map_blocks(np.abs, y, split_axis=0)
    k = joined(z)
    assert steps(z) == [["double", "absolute"]]
    np.testing.assert_array_equal(z.compute(), np.abs(a * 2))
    assert z.chunks == x.chunks
    assert wait_until_idle()["partitions"] == x.npartitions // k


def test_topk_over_other_axes_after_an_auto_stage_is_left_to_dask(auto_joins):
    # Over the batch's own axis it runs on each block; over another, it was taken onto
    # the batch as a reduction's step, declared one element, and the partition failed.
    a, x = small()
    y = dask_overlap.map_blocks(double, x, split_axis=0)
    z = da.topk(y, 2, axis=1)
    assert steps(z) == [["double"]]
    np.testing.assert_array_equal(z.compute(), da.topk(x * 2, 2, axis=1).compute())


@pytest.mark.parametrize("batch", [1, "auto"])
def test_a_step_that_reduces_a_negative_axis_is_taken_as_its_positive_one(auto_joins, batch):
    a, x = small()
    y = dask_overlap.map_blocks(double, x, split_axis=0, batch=batch)
    kw = {"axis": -2, "keepdims": True, "chunks": ((1,) * x.numblocks[0], (16,))}
    got = y.map_blocks(np.sum, **kw)
    assert [s[-1] for s in steps(got)] == ["sum"]
    np.testing.assert_array_equal(got.compute(), (x * 2).map_blocks(np.sum, **kw).compute())


def test_three_auto_stages_are_one_program_of_three_steps(auto_joins):
    """The last two fuse first (the order of the batch path's layers), then the first
    takes them in: their steps are spliced in, not one step of a nested program, so
    explain() and an error's note count and name every step."""
    a, x = small()

    def fails_in_the_last(b: Any) -> Any:
        raise Bad("bad value encountered")

    y = dask_overlap.map_blocks(double, x, split_axis=0)
    z = dask_overlap.map_blocks(np.abs, y, split_axis=0)
    assert steps(dask_overlap.map_blocks(np.negative, z, split_axis=0)) == [
        ["double", "absolute", "negative"]
    ]
    w = dask_overlap.map_blocks(fails_in_the_last, z, split_axis=0, dtype=x.dtype)
    with pytest.raises(Bad) as info:
        w.compute(scheduler="sync")
    assert any("fused step 3 of 3: fails_in_the_last" in n for n in info.value.__notes__)


@pytest.mark.parametrize(
    "build, taken",
    [
        (lambda x: (x * 2 + 1).astype("f4"), ["mul", "add", "astype"]),
        (lambda x: da.sqrt(abs(x)), ["abs", "sqrt"]),
        (lambda x: x.map_blocks(np.sort), []),  # not elementwise: never on a joined batch
        (lambda x: da.where(x > 0, x, 0), []),  # the last step reads two arrays
    ],
    ids=["mul-add-astype", "sqrt-abs", "sort", "two-inputs"],
)
@pytest.mark.parametrize("batch", ["auto", 4])
def test_elementwise_steps_before_a_batched_stage_run_on_its_joined_batches(
    auto_joins, build, taken, batch
):
    a, x = small()
    z = dask_overlap.map_blocks(double, build(x), split_axis=0, batch=batch)
    k = joined(z) if batch == "auto" else batch
    assert steps(z) == [[*taken, "double"]]
    got = z.compute()
    want = build(x).map_blocks(double)
    if batch != "auto":  # the stage's blocks are its batches
        want = want.rechunk({0: 64 * batch})
    assert z.chunks == want.chunks and got.dtype == want.dtype
    np.testing.assert_array_equal(got, want.compute())
    stats = wait_until_idle()
    assert stats["partitions"] == x.npartitions // k
    if taken:
        assert stats["bytes_h2d"] == a.nbytes  # x's blocks handed in, not the step's


def test_an_elementwise_step_between_two_auto_stages_leaves_one_partition_a_batch(auto_joins):
    # The second stage's join of the step's blocks lines up with the first stage's batches:
    # it reads those batches as they are, and the step runs between the two on the device.
    a, x = small()
    y = dask_overlap.map_blocks(double, x, split_axis=0)
    z = dask_overlap.map_blocks(np.abs, (y * 3).astype("f4"), split_axis=0)
    k = joined(z)
    assert steps(z) == [["double", "mul", "astype", "absolute"]]
    np.testing.assert_array_equal(z.compute(), np.abs((a * 2 * 3).astype("f4")))
    assert wait_until_idle()["partitions"] == x.npartitions // k


def on_the_batch(a: np.ndarray, build: Any) -> da.Array:
    """``build`` on a plain Dask stage over ``a``'s blocks: what a fused one must equal."""
    return build(da.from_array(a, chunks=(64, 16)).map_blocks(double))


@pytest.mark.parametrize(
    "build, taken",
    [
        (lambda y: y * 2 + 1, ["mul", "add"]),
        (lambda y: y.astype("f4").max(axis=1), ["astype", "chunk_max"]),
        (lambda y: y.sum(axis=1, keepdims=True), ["sum"]),
    ],
    ids=["elementwise", "astype-max", "sum-rows"],
)
def test_steps_after_an_auto_stage_run_on_its_batches_before_the_cut_back(auto_joins, build, taken):
    # Running these on a batch is running them on each of its blocks: the cut cuts their
    # output, and nothing is said to run block by block.
    a, x = small()
    z = build(dask_overlap.map_blocks(double, x, split_axis=0))
    k = joined(z)
    assert steps(z) == [["double", *taken]]
    assert "on each block" not in dask_overlap.explain(z)
    want = on_the_batch(a, build)
    got = z.compute()
    assert z.chunks == want.chunks and got.dtype == want.dtype
    np.testing.assert_array_equal(got, want.compute())
    assert wait_until_idle()["partitions"] == x.npartitions // k


BATCH_REDUCTIONS = [*REDUCTIONS, "nanmin", "nanprod", "nanvar", "nanstd"]


@pytest.mark.parametrize("how", BATCH_REDUCTIONS)
@pytest.mark.parametrize("axis", [None, 0, 1, (0, 1)], ids=["all", "0", "1", "both"])
@pytest.mark.parametrize("keepdims", [False, True], ids=["", "keepdims"])
def test_reductions_after_an_auto_stage_take_their_first_step_into_its_batches(
    auto_joins, how, axis, keepdims
):
    # Along the batches' axis, or with a partial that is a dict (mean, var, std), the step
    # runs on each block of a batch and the cut takes each block's partial: Dask's tree
    # then gets exactly the partials it would have made.
    a, x = small()

    def build(y: da.Array) -> da.Array:
        return getattr(da, how)(y * 0.5 + 1, axis=axis, keepdims=keepdims)

    z = build(dask_overlap.map_blocks(double, x, split_axis=0))
    k = joined(z)
    chain = steps(z)
    assert len(chain) == 1 and chain[0][:3] == ["double", "mul", "add"], chain
    assert len(chain[0]) == 4, dask_overlap.explain(z)
    want = on_the_batch(a, build)
    got = z.compute()
    assert z.chunks == want.chunks and got.dtype == want.dtype
    np.testing.assert_array_equal(got, want.compute())
    stats = wait_until_idle()
    assert stats["partitions"] == x.npartitions // k
    assert stats["bytes_d2h"] < a.nbytes // 4  # partials, not blocks


LAYOUTS = {  # shape, chunks, split_axis
    "last-block-short": ((1000, 7), (16, 7), 0),  # a last batch of blocks of two extents
    "split-axis-1": ((8, 2048), (8, 32), 1),  # each block a strided piece of its batch
    "3-d": ((6, 1024, 5), (6, 16, 5), 1),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("how", ["sum", "mean", "var", "nanmax"])
@pytest.mark.parametrize("axis", [None, "split", "other"])
def test_reductions_after_an_auto_stage_of_other_layouts(auto_joins, layout, how, axis):
    # Blocks of one extent, contiguous in their batch, are folded into one call of the
    # step (each reduced as it would be alone); others run block by block: exactly
    # Dask's either way.
    shape, chunks, split = LAYOUTS[layout]
    a = np.random.default_rng(5).standard_normal(shape)
    x = da.from_array(a, chunks=chunks)
    ax = {None: None, "split": split, "other": (split + 1) % len(shape)}[axis]

    def build(y: da.Array) -> da.Array:
        return getattr(da, how)(y * 0.5 + 1, axis=ax)

    z = build(dask_overlap.map_blocks(double, x, split_axis=split))
    joined(z)
    assert len(steps(z)) == 1 and len(steps(z)[0]) == 4
    want = build(x.map_blocks(double))
    got = z.compute()
    assert z.chunks == want.chunks and got.dtype == want.dtype
    np.testing.assert_array_equal(got, want.compute())


@pytest.mark.parametrize(
    "build",
    [
        lambda y: (y > 0).any(axis=0),
        lambda y: (y > 0).all(axis=1, keepdims=True),
        lambda y: y.sum(axis=0, dtype="f4"),
        lambda y: y.astype("f4").mean(axis=0, dtype="f8"),
        lambda y: y.var(axis=0, ddof=1),
    ],
    ids=["any-0", "all-1", "sum-dtype", "mean-dtype", "var-ddof"],
)
def test_more_reductions_after_an_auto_stage(auto_joins, build):
    a, x = small()
    z = build(dask_overlap.map_blocks(double, x, split_axis=0))
    joined(z)
    assert len(steps(z)) == 1 and len(steps(z)[0]) >= 2
    want = on_the_batch(a, build)
    got = z.compute()
    assert z.chunks == want.chunks and got.dtype == want.dtype
    np.testing.assert_array_equal(got, want.compute())


def test_explain_says_what_runs_on_each_block_of_a_batch(auto_joins):
    a, x = small()
    y = dask_overlap.map_blocks(double, x, split_axis=0)
    k = joined(y)
    text = dask_overlap.explain(y.sum(axis=0))
    assert f": {x.npartitions // k} partitions of double -> sum (fused: 2 steps" in text
    assert text.endswith(f", whole partitions, batches of {k} blocks: sum on each block")
    stored = da.store(y, np.zeros(a.shape), lock=False, compute=False)
    assert dask_overlap.explain(stored).endswith(
        f"(fused: 2 steps, one copy in and one out), batches of {k} blocks: each block "
        "stored in its region"
    )


@pytest.mark.parametrize(
    "build, label",
    [
        (lambda y: y.map_blocks(np.sort, axis=0), "sort"),
        (lambda y: y.map_blocks(np.cumsum, axis=0), "cumsum"),
        (lambda y: da.cumsum(y, axis=0), "cumsum"),
        (lambda y: y.map_blocks(np.diff, axis=0, chunks=((63,) * 64, (16,))), "diff"),
    ],
    ids=["sort", "cumsum", "da-cumsum", "diff-shorter"],
)
def test_a_step_that_is_not_elementwise_after_an_auto_stage_runs_on_each_block(
    auto_joins, build, label
):
    a, x = small()
    z = build(dask_overlap.map_blocks(double, x, split_axis=0))
    k = joined(z)
    assert steps(z) == [["double", label]]
    assert dask_overlap.explain(z).endswith(f"batches of {k} blocks: {label} on each block")
    want = on_the_batch(a, build)
    got = z.compute()
    assert z.chunks == want.chunks and got.shape == want.shape
    np.testing.assert_array_equal(got, want.compute())
    assert wait_until_idle()["partitions"] == x.npartitions // k


def test_nothing_is_taken_through_results_one_a_block(auto_joins):
    # Each block's result is its own (np.diff's may even be shorter): a step after them
    # is left as it is, and reads them from the cut.
    a, x = small()

    def build(y: da.Array) -> da.Array:
        return y.map_blocks(np.sort, axis=0) * 2 + 1

    z = build(dask_overlap.map_blocks(double, x, split_axis=0))
    joined(z)
    assert steps(z) == [["double", "sort"]]
    np.testing.assert_array_equal(z.compute(), on_the_batch(a, build).compute())


def test_a_step_run_on_each_block_that_raises_is_named(auto_joins):
    a, x = small()
    y = dask_overlap.map_blocks(double, x, split_axis=0)
    z = y.map_blocks(np.sort, axis=0, kind="no", dtype=y.dtype)
    k = joined(z)
    (batched,) = [n for n in z.__dask_graph__().layers if n.startswith(f"double-batch{k}")]
    with pytest.raises(ValueError, match="sort kind") as info:
        z.compute(scheduler="sync")
    notes = "\n".join(info.value.__notes__)
    assert "fused step 2 of 2: sort" in notes
    assert f"partition ('{batched}', 1, 0)" in notes  # its key, not the cut's


@pytest.mark.parametrize("fn", [np.sort, np.cumsum], ids=["sort", "cumsum"])
def test_a_step_that_is_not_elementwise_before_a_batched_stage_is_left_as_it_is(auto_joins, fn):
    a, x = one_d()
    small = x.rechunk(64)  # 64 blocks of 512 B
    z = dask_overlap.map_blocks(double, small.map_blocks(fn), split_axis=0)
    joined(z)
    assert steps(z) == [["double"]]  # (never on the joined batch)
    assert z.chunks == small.chunks
    np.testing.assert_array_equal(z.compute(), small.map_blocks(fn).compute() * 2)


def test_a_store_after_an_auto_stage_fills_each_batchs_region_in_place(auto_joins, recording):
    a, x = small()
    y = dask_overlap.map_blocks(double, x, split_axis=0, sub_chunk_bytes="16KiB")
    k = joined(y)
    target = np.zeros(a.shape).view(recording)
    stored = da.store(y, target, lock=False, compute=False)
    assert steps(stored) == [["double", "store"]]
    stored.compute()
    np.testing.assert_array_equal(np.asarray(target), a * 2)
    assert recording.writes == 0  # each batch's sub-chunks went into its region itself
    stats = wait_until_idle()
    assert stats["partitions"] == x.npartitions // k
    assert stats["sub_chunks"] > x.npartitions // k  # (a store is not a whole-block step)


@pytest.mark.parametrize(
    "kwargs",
    [{"lock": True}, {"regions": (slice(16, 4112),)}, {"return_stored": True}, {}],
    ids=["lock", "regions", "return-stored", "strided"],
)
def test_a_store_after_an_auto_stage_does_what_dask_store_does(auto_joins, recording, kwargs):
    a, x = small()
    y = dask_overlap.map_blocks(double, x, split_axis=0)
    k = joined(y)
    shape = (4128, 16) if "regions" in kwargs else a.shape
    got, want = np.zeros(shape), np.zeros(shape)
    if not kwargs:  # a region not filled in place: written block by block, as Dask writes it
        got = np.zeros(shape[::-1]).T.view(recording)
    assert steps(da.store(y, got, compute=False, **kwargs)) == [["double", "store"]]
    out = da.store(y, got, **kwargs)
    assert wait_until_idle()["partitions"] == x.npartitions // k
    with dask.config.set({"overlap.fuse": False}):
        expected = da.store(y, want, **kwargs)
    np.testing.assert_array_equal(np.asarray(got), want)
    if not kwargs:
        assert recording.writes == x.npartitions
    if kwargs.get("return_stored"):
        assert out.chunks == expected.chunks
        np.testing.assert_array_equal(out.compute(), expected.compute())


def test_to_zarr_after_an_auto_stage(auto_joins, tmp_path):
    zarr = pytest.importorskip("zarr")
    a, x = small()
    y = dask_overlap.map_blocks(double, x, split_axis=0)
    k = joined(y)
    assert steps(y.to_zarr(str(tmp_path / "a.zarr"), compute=False)) == [["double", "store"]]
    y.to_zarr(str(tmp_path / "b.zarr"))
    np.testing.assert_array_equal(zarr.open(str(tmp_path / "b.zarr"))[:], a * 2)
    assert wait_until_idle()["partitions"] == x.npartitions // k


def test_a_dict_partial_over_other_axes_is_made_once_a_batch_and_cut(auto_joins):
    a, x = small()
    y = dask_overlap.map_blocks(double, x, split_axis=0)
    k = joined(y)
    z = y.mean(axis=1)
    assert dask_overlap.explain(z).endswith(
        f"batches of {k} blocks: mean_chunk's partial cut into the blocks'"
    )
    np.testing.assert_array_equal(z.compute(), on_the_batch(a, lambda y: y.mean(axis=1)).compute())


def test_each_block_runs_a_step_on_the_batch_only_where_its_partial_can_be_cut():
    calls: list[tuple] = []

    def partial(b: np.ndarray, scalar: bool) -> dict:
        calls.append(b.shape)
        total = b.sum(axis=1, keepdims=True)
        return {"total": total, "n": b.shape[1] if scalar else np.full_like(total, b.shape[1])}

    batch = np.arange(24.0).reshape(6, 4)
    for scalar, made in [(False, [(6, 4)]), (True, [(6, 4), (2, 4), (3, 4), (1, 4)])]:
        calls.clear()
        step = EachBlock(Call("p", partial, (PREVIOUS, scalar), {}), 0, (2, 3, 1), how="batch")
        out = step(batch).results
        assert calls == made  # (a scalar count cannot be cut: made block by block instead)
        np.testing.assert_array_equal(out[1]["total"], batch[2:5].sum(axis=1, keepdims=True))


@pytest.mark.parametrize(
    "batch, extents, calls",
    [
        (np.arange(24.0).reshape(6, 4), (2, 2, 2), 1),  # folded: one call
        (np.arange(24.0).reshape(6, 4), (2, 3, 1), 3),  # blocks of other extents
        (np.asfortranarray(np.arange(24.0).reshape(6, 4)), (2, 2, 2), 3),  # strided blocks
    ],
    ids=["folded", "extents", "strided"],
)
def test_each_block_folds_a_batch_only_where_each_block_is_reduced_as_alone(batch, extents, calls):
    made: list[tuple] = []

    def total(b: np.ndarray) -> np.ndarray:
        made.append(b.shape)
        return np.sum(b, axis=(0,), keepdims=True)

    out = EachBlock(Call("t", total, (PREVIOUS,), {}), 0, extents, how="fold")(batch).results
    assert len(made) == calls
    starts = np.cumsum((0, *extents))
    for r, lo, hi in zip(out, starts, starts[1:], strict=False):
        np.testing.assert_array_equal(r, batch[lo:hi].sum(axis=0, keepdims=True))


def test_results_one_a_block_come_back_in_one_copy_where_they_can_be_joined():
    # The cuda backend's path, with NumPy arrays standing for device ones: partials of a
    # batch's blocks, joined along the cut's axis on the device, come back in one copy a
    # key, and each block's result is a view of it.
    fetched: list[tuple] = []

    def fetch(v: np.ndarray) -> np.ndarray:
        fetched.append(v.shape)
        return v.copy()

    parts = [{"n": np.full((1, 3), i), "total": np.full((1, 3), 2.0 * i)} for i in range(4)]
    out = PerBlock(parts, axis=0).fetched(lambda v: True, fetch)
    assert fetched == [(4, 3), (4, 3)] and len(out) == 4
    for i, r in enumerate(out):
        np.testing.assert_array_equal(r["total"], parts[i]["total"])
    fetched.clear()
    odd = [np.ones((2, 3)), np.ones((1, 4))]  # not joinable: one copy each
    out = PerBlock(odd, axis=0).fetched(lambda v: True, fetch)
    assert fetched == [(2, 3), (1, 4)] and [r.shape for r in out] == [(2, 3), (1, 4)]
    mixed = [{"n": np.ones(1)}, None]  # (no device array: as it is)
    assert PerBlock(mixed, axis=0).fetched(lambda v: False, fetch)[1] is None


# -- clusters ------------------------------------------------------------------------------
def test_a_fused_pipeline_on_worker_processes():
    a, x = data()
    z = (stage(np.abs, stage(double, x)) * 3).sum(axis=0)
    with (
        LocalGPUCluster(allow_cpu=True, n_workers=2, threads_per_worker=1) as cluster,
        Client(cluster) as client,
    ):
        got = client.compute(z).result()
        partitions = sum(s["partitions"] for s in client.run(dask_overlap.runtime_stats).values())
    np.testing.assert_allclose(got, (np.abs(a * 2) * 3).sum(axis=0))
    assert partitions == x.npartitions


def test_results_one_a_block_on_worker_processes(auto_joins):
    # Each batch's partials travel as one tuple, and each block's task takes its own, on
    # whichever worker; the tree reduces them there.
    a, x = small()
    with (
        LocalGPUCluster(allow_cpu=True, n_workers=2, threads_per_worker=1) as cluster,
        Client(cluster) as client,
    ):
        z = dask_overlap.map_blocks(double, x, split_axis=0).mean(axis=0)
        k = joined(z)
        got = client.compute(z).result()
        partitions = sum(s["partitions"] for s in client.run(dask_overlap.runtime_stats).values())
    np.testing.assert_array_equal(got, on_the_batch(a, lambda y: y.mean(axis=0)).compute())
    assert partitions == x.npartitions // k


# -- on the GPU ----------------------------------------------------------------------------
@pytest.fixture
def cuda() -> Any:
    from support import require_gpu

    cp = require_gpu()
    with dask.config.set({"overlap.backend": "cuda", "overlap.pinned-pool-size": "256MiB"}):
        yield cp


@pytest.mark.gpu
@pytest.mark.parametrize("out", ["host", "device"])
def test_a_fused_chain_on_the_gpu(cuda, out):
    a = np.random.default_rng(3).standard_normal((4096, 256)).astype("f4")
    x = da.from_array(a, chunks=(512, 256))
    y = dask_overlap.map_blocks(
        lambda b: b - b.mean(axis=1, keepdims=True), x, split_axis=0, sub_chunk_bytes="128KiB"
    )
    z = dask_overlap.map_blocks(lambda b: abs(cuda.fft.rfft(b, axis=1)) ** 2, y, split_axis=0,
                                chunks=(x.chunks[0], (129,)), dtype="f4", out=out)  # fmt: skip
    w = da.log10(z + 1) * 2
    assert [len(s) for s in steps(w)] == [5], dask_overlap.explain(w)
    got = w.compute()
    got = cuda.asnumpy(got) if out == "device" else got
    d = a - a.mean(axis=1, keepdims=True)
    np.testing.assert_allclose(got, np.log10(abs(np.fft.rfft(d, axis=1)) ** 2 + 1) * 2, rtol=1e-3)
    stats = wait_until_idle()
    assert stats["partitions"] == x.npartitions and stats["sub_chunks"] > x.npartitions


@pytest.mark.gpu
@pytest.mark.parametrize("how", ["sum", "mean", "var", "max", "nanmean"])
@pytest.mark.parametrize("axis", [None, 0, 1])
def test_a_fused_reduction_on_the_gpu(cuda, how, axis):
    a = np.random.default_rng(4).standard_normal((2048, 128))
    x = da.from_array(a, chunks=(256, 128))
    z = getattr(da, how)(dask_overlap.map_blocks(lambda b: b * b, x, split_axis=0), axis=axis)
    assert [len(s) for s in steps(z)] == [2]
    got = z.compute()
    np.testing.assert_allclose(np.asarray(got), getattr(np, how)(a * a, axis=axis), rtol=1e-9)
    stats = wait_until_idle()
    assert stats["partitions"] == x.npartitions
    assert stats["bytes_d2h"] < a.nbytes // 8  # only the partials came back


@pytest.mark.gpu
@pytest.mark.parametrize("target_kind", ["ndarray", "strided"])
def test_a_fused_store_on_the_gpu(cuda, target_kind):
    a = np.random.default_rng(5).standard_normal((4096, 256)).astype("f4")
    x = da.from_array(a, chunks=(512, 256))
    y = dask_overlap.map_blocks(
        lambda b: b * 2 + 1, x, split_axis=0, sub_chunk_bytes="128KiB", batch=1
    )
    target = np.zeros(a.shape, "f4")
    if target_kind == "strided":
        target = np.zeros(a.shape[::-1], "f4").T
    stored = da.store(y, target, lock=False, compute=False)
    assert [len(s) for s in steps(stored)] == [2]
    stored.compute()
    np.testing.assert_allclose(target, a * 2 + 1, rtol=1e-6)
    stats = wait_until_idle()
    assert stats["partitions"] == x.npartitions and stats["bytes_d2h"] == a.nbytes


@pytest.mark.gpu
def test_elementwise_steps_before_a_stage_on_the_gpu(cuda):
    a = np.random.default_rng(6).standard_normal((4096, 256))
    x = da.from_array(a, chunks=(512, 256))
    y = (x * 2 + 1).astype("f4")
    z = dask_overlap.map_blocks(row_sums, y, split_axis=0, sub_chunk_bytes="256KiB", drop_axis=1)
    assert steps(z) == [["mul", "add", "astype", "row_sums"]]
    got = z.compute()
    np.testing.assert_allclose(got, (a * 2 + 1).astype("f4").sum(axis=1), rtol=1e-4)
    stats = wait_until_idle()
    assert stats["partitions"] == x.npartitions and stats["bytes_h2d"] == a.nbytes


# On the GPU, batch="auto" over small blocks (the blocks below are 64 KiB: joined).
def small_on_the_gpu(dtype: str = "f8") -> tuple[np.ndarray, da.Array]:
    a = np.random.default_rng(7).standard_normal((4096, 128)).astype(dtype)
    return a, da.from_array(a, chunks=(64, 128))


@pytest.mark.gpu
@pytest.mark.parametrize("how", ["sum", "mean", "var", "max", "nanmean"])
@pytest.mark.parametrize("axis", [None, 0, 1])
def test_a_fused_reduction_over_auto_batches_on_the_gpu(cuda, how, axis):
    a, x = small_on_the_gpu()
    z = getattr(da, how)(dask_overlap.map_blocks(lambda b: b * b, x, split_axis=0), axis=axis)
    k = joined(z)
    assert [len(s) for s in steps(z)] == [2], dask_overlap.explain(z)
    got = z.compute()
    np.testing.assert_allclose(np.asarray(got), getattr(np, how)(a * a, axis=axis), rtol=1e-9)
    stats = wait_until_idle()
    assert stats["partitions"] == x.npartitions // k
    assert stats["bytes_d2h"] < a.nbytes // 8  # only the partials came back


@pytest.mark.gpu
def test_a_step_that_is_not_elementwise_after_an_auto_stage_on_the_gpu(cuda):
    a, x = small_on_the_gpu("f4")
    z = dask_overlap.map_blocks(lambda b: b * 2, x, split_axis=0).map_blocks(np.sort, axis=0)
    k = joined(z)
    assert [len(s) for s in steps(z)] == [2] and "sort on each block" in dask_overlap.explain(z)
    want = np.concatenate([np.sort(a[i : i + 64] * 2, axis=0) for i in range(0, len(a), 64)])
    np.testing.assert_array_equal(z.compute(), want)
    stats = wait_until_idle()
    assert stats["partitions"] == x.npartitions // k and stats["bytes_d2h"] == a.nbytes


@pytest.mark.gpu
def test_a_fused_store_after_an_auto_stage_on_the_gpu(cuda):
    a, x = small_on_the_gpu("f4")
    y = dask_overlap.map_blocks(lambda b: b * 2 + 1, x, split_axis=0)
    k = joined(y)
    target = np.zeros(a.shape, "f4")
    stored = da.store(y, target, lock=False, compute=False)
    assert [len(s) for s in steps(stored)] == [2]
    stored.compute()
    np.testing.assert_allclose(target, a * 2 + 1, rtol=1e-6)
    stats = wait_until_idle()
    assert stats["partitions"] == x.npartitions // k and stats["bytes_d2h"] == a.nbytes


@pytest.mark.gpu
def test_elementwise_steps_before_an_auto_stage_on_the_gpu(cuda):
    a, x = small_on_the_gpu()
    y = dask_overlap.map_blocks(np.abs, (x * 2 + 1).astype("f4"), split_axis=0)
    k = joined(y)
    assert steps(y) == [["mul", "add", "astype", "absolute"]]
    np.testing.assert_allclose(y.compute(), np.abs((a * 2 + 1).astype("f4")), rtol=1e-6)
    stats = wait_until_idle()
    assert stats["partitions"] == x.npartitions // k and stats["bytes_h2d"] == a.nbytes
