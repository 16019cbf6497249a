"""Bad input: clear errors, at graph construction where they can be known there.

And a ``func`` that raises: the same exception reaches the caller, and the runtime is
left with nothing in flight or in use.
"""

from __future__ import annotations

import re

import dask
import dask.array as da
import numpy as np
import pytest
from support import Boom, failing_at, pinned_in_use_once_collected, rows_data, wait_until_idle

import dask_overlap


def identity(b):
    return b


@pytest.fixture
def x() -> da.Array:
    return da.from_array(np.arange(48.0).reshape(8, 6), chunks=(4, 3))


def raises_at_construction(exc_type, *fragments):
    """``pytest.raises`` that also checks the message names every fragment."""
    pattern = "".join(f"(?=.*{re.escape(str(f))})" for f in fragments)
    return pytest.raises(exc_type, match=re.compile(pattern, re.S))


def assert_no_task_ran() -> None:
    """Errors known at graph construction come before any partition task runs."""
    stats = dask_overlap.runtime_stats()
    assert stats["partitions"] == 0, stats


# -- at graph construction --------------------------------------------------------------
def test_no_array_and_no_chunks():
    with raises_at_construction(ValueError, "arrays", "chunks=", "no dask array"):
        dask_overlap.map_blocks(lambda: np.ones(3))
    with raises_at_construction(ValueError, "arrays", "chunks=", "1 positional"):
        dask_overlap.map_blocks(lambda c: np.ones(3) * c, 5.0)
    assert_no_task_ran()


@pytest.mark.parametrize(
    "values, shown",
    [
        (np.array([1, "a", None], dtype=object), "object"),
        (np.array(["ab", "cd", "ef"]), "<U2"),
        (np.array([b"a", b"b", b"c"]), "|S1"),
        (np.array(["2020-01-01"] * 3, dtype="M8[D]"), "datetime64[D]"),
        (np.array([1, 2, 3], dtype="m8[s]"), "timedelta64[s]"),
    ],
    ids=["object", "str", "bytes", "datetime", "timedelta"],
)
def test_non_numeric_input_dtype(values, shown):
    good = da.ones(3, chunks=1)
    bad = da.from_array(values, chunks=1)
    with raises_at_construction(TypeError, "arrays[1]", "numeric", shown):
        dask_overlap.map_blocks(lambda a, b: a, good, bad, dtype=float)
    assert_no_task_ran()


@pytest.mark.parametrize(
    "dtype, shown", [(object, "object"), (str, "<U0"), ("M8[ns]", "datetime64[ns]")]
)
def test_non_numeric_output_dtype(x, dtype, shown):
    with raises_at_construction(TypeError, "dtype", "numeric", shown):
        dask_overlap.map_blocks(identity, x, dtype=dtype)
    meta = np.empty((0, 0), dtype=dtype)
    with raises_at_construction(TypeError, "meta", "numeric", meta.dtype):
        dask_overlap.map_blocks(identity, x, meta=meta)
    assert_no_task_ran()


def test_non_numeric_inferred_output_dtype(x):
    with raises_at_construction(TypeError, "dtype", "numeric", "object"):
        dask_overlap.map_blocks(lambda b: b.astype(object), x)
    assert_no_task_ran()


@pytest.mark.parametrize(
    "func, returned",
    [(lambda b: b.tolist(), "list"), (lambda b: "done", "str"), (lambda b: None, "NoneType")],
)
def test_inferring_the_dtype_of_a_func_that_returns_no_array(x, func, returned):
    """The error names what came back, not the dtype NumPy would make of it."""
    with raises_at_construction(TypeError, "must return an array", f"got {returned}", "infer"):
        dask_overlap.map_blocks(func, x)
    assert_no_task_ran()


def test_masked_input_is_refused_before_any_work():
    a = np.array([[1.0, np.nan], [3.0, 4.0]])
    m = da.ma.masked_invalid(da.from_array(a, chunks=1))
    with raises_at_construction(TypeError, "arrays[1]", "masked array", "mask would be lost"):
        dask_overlap.map_blocks(np.add, da.from_array(a, chunks=1), m)
    assert_no_task_ran()


class ForeignBlock:
    """An array of another library, as far as Dask's meta goes (sparse.COO, pandas.Series)."""

    def __init__(self, b):
        self.shape, self.dtype = np.shape(b), np.asarray(b).dtype


def test_a_meta_of_foreign_blocks_is_refused_before_any_work(x):
    """A meta given that is no NumPy or CuPy array (Dask would map sparse or pandas blocks
    as such; the copies would lose them) is refused by name."""
    with raises_at_construction(TypeError, "meta is a", "ForeignBlock", "NumPy or CuPy"):
        dask_overlap.map_blocks(identity, x, meta=ForeignBlock(np.empty((0, 0))))
    assert_no_task_ran()


def test_a_func_that_returns_foreign_blocks_is_refused_before_any_work(x):
    """Where Dask infers the meta (func on empty NumPy blocks), the same refusal names it."""
    for dtype in (float, None):
        with raises_at_construction(
            TypeError, "ForeignBlock's output on empty NumPy blocks", "ForeignBlock"
        ):
            dask_overlap.map_blocks(ForeignBlock, x, dtype=dtype)
    assert_no_task_ran()


def test_a_masked_block_under_a_plain_meta_is_refused_when_it_arrives():
    """A meta can say less than its blocks: the runner refuses the block itself."""
    a = np.ma.masked_invalid(np.array([[1.0, np.nan], [3.0, 4.0]]))
    x = da.from_array(a, chunks=1, meta=np.empty((0, 0)), asarray=False)
    y = dask_overlap.map_blocks(np.negative, x, dtype=float)
    with pytest.raises(TypeError, match="masked array"):
        y.compute(scheduler="sync")
    stats = dask_overlap.runtime_stats()
    # Refused before its layout: counted all the same, as a failed partition.
    assert stats["partitions"] == stats["partitions_failed"] == 1


@pytest.mark.parametrize("value", [1, "yes", None])
def test_enforce_ndim_not_a_bool(x, value):
    with raises_at_construction(TypeError, "enforce_ndim", repr(value)):
        dask_overlap.map_blocks(identity, x, enforce_ndim=value)


@pytest.mark.parametrize("axis", [2, 5, -3, -10])
def test_split_axis_out_of_range(x, axis):
    with raises_at_construction(ValueError, "split_axis", "[-2, 2)", f"got {axis}"):
        dask_overlap.map_blocks(identity, x, split_axis=axis)
    assert_no_task_ran()


@pytest.mark.parametrize("axis", [1.0, True, "0", [0]])
def test_split_axis_not_an_integer(x, axis):
    with raises_at_construction(TypeError, "split_axis", "integer", repr(axis)):
        dask_overlap.map_blocks(identity, x, split_axis=axis)
    assert_no_task_ran()


def test_split_axis_dropped(x):
    with raises_at_construction(ValueError, "split_axis=1", "drop_axis"):
        dask_overlap.map_blocks(lambda b: b.max(axis=1), x, split_axis=1, drop_axis=1)
    assert_no_task_ran()


@pytest.mark.parametrize("value", [0, -1, 1.5, True, "lots", "0B", "-5MiB"])
def test_sub_chunk_bytes_not_positive(x, value):
    with raises_at_construction(ValueError, "sub_chunk_bytes", "positive", repr(value)):
        dask_overlap.map_blocks(identity, x, split_axis=0, sub_chunk_bytes=value)
    assert_no_task_ran()


@pytest.mark.parametrize("value", ["gpu", "HOST", None, 1])
def test_out_not_one_of_the_modes(x, value):
    with raises_at_construction(
        ValueError, "out must be one of 'host', 'pinned', 'device'", repr(value)
    ):
        dask_overlap.map_blocks(identity, x, out=value)
    assert_no_task_ran()


@pytest.mark.parametrize("value", [0, -1, 1.5, True, "2", 2.0])
def test_in_flight_not_a_positive_integer(x, value):
    with raises_at_construction(ValueError, "in_flight", "positive integer", repr(value)):
        dask_overlap.map_blocks(identity, x, in_flight=value)
    assert_no_task_ran()


@pytest.mark.parametrize(
    "key, value, name",
    [
        ("overlap.in-flight", 0, "in_flight"),
        ("overlap.sub-chunk-bytes", "lots", "sub_chunk_bytes"),
        ("overlap.streams", -2, "streams"),
    ],
)
def test_bad_values_from_config(x, key, value, name):
    with dask.config.set({key: value}):
        with raises_at_construction(ValueError, name, repr(value)):
            dask_overlap.map_blocks(identity, x)
    assert_no_task_ran()


@pytest.mark.parametrize("func", [3, None, "np.sin", np.arange(3)])
def test_func_not_callable(x, func):
    with raises_at_construction(TypeError, "func", "callable", repr(func), type(func).__name__):
        dask_overlap.map_blocks(func, x)
    assert_no_task_ran()


@pytest.mark.parametrize("name", ["gpu", "CUDA", "", "numpy"])
def test_unknown_backend_from_config(x, name):
    with dask.config.set({"overlap.backend": name}):
        with raises_at_construction(ValueError, "backend", "auto", "host", repr(name)):
            dask_overlap.map_blocks(identity, x)
    assert_no_task_ran()


def test_unknown_backend_name_to_the_runtime():
    with raises_at_construction(ValueError, "backend", repr("tpu")):
        dask_overlap.get_runtime("tpu")
    with raises_at_construction(ValueError, "backend", repr("tpu")):
        dask_overlap.runtime_stats("tpu")


# -- raised from the task, naming the partition -----------------------------------------
@pytest.mark.parametrize("split_axis", [None, 0, 1])
@pytest.mark.parametrize("returned", [[1.0, 2.0], "text", None, 3.0])
def test_func_returns_a_non_array(x, split_axis, returned):
    y = dask_overlap.map_blocks(
        lambda b: returned, x, dtype=float, split_axis=split_axis, sub_chunk_bytes=8
    )
    with raises_at_construction(TypeError, "must return an array", type(returned).__name__):
        y.compute()
    with pytest.raises(TypeError, match=re.escape(f"partition ('{y.name}', ")):
        y.compute()


@pytest.mark.parametrize("split_axis", [0, 1, -1])
@pytest.mark.parametrize("sub_chunk_bytes", [8, 10**6])  # many sub-chunks, or one
def test_func_changes_the_extent_along_split_axis(x, split_axis, sub_chunk_bytes):
    axis = split_axis % 2

    def shrink(b):
        return np.delete(b, 0, axis=axis)

    y = dask_overlap.map_blocks(shrink, x, split_axis=split_axis, sub_chunk_bytes=sub_chunk_bytes)
    with raises_at_construction(
        ValueError, f"split_axis={axis}", "extent", "shrink", f"partition ('{y.name}', "
    ):
        y.compute()


def test_inputs_disagree_along_split_axis():
    """Dask aligns by block position; sub-chunks need the same extent (or 1)."""
    a = da.arange(40, chunks=10)
    b = da.arange(20, chunks=5)
    y = dask_overlap.map_blocks(lambda u, v: u[: len(v)] + v, a, b, chunks=(5,), split_axis=0)
    with raises_at_construction(
        ValueError, "split_axis=0", "same extent", "arrays[0]: 10", "arrays[1]: 5", y.name
    ):
        y.compute()
    # without split_axis it is what Dask gives
    z = dask_overlap.map_blocks(lambda u, v: u[: len(v)] + v, a, b, chunks=(5,))
    np.testing.assert_array_equal(
        z.compute(), da.map_blocks(lambda u, v: u[: len(v)] + v, a, b, chunks=(5,)).compute()
    )


# -- a func that raises -----------------------------------------------------------------
ROWS, COLS, CHUNK = 24, 4, 8  # three partitions of eight one-row sub-chunks


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "row", [CHUNK, CHUNK + CHUNK // 2, 2 * CHUNK - 1], ids=["first", "middle", "last"]
)
@pytest.mark.parametrize("split_axis", [0, None])
@pytest.mark.parametrize("in_flight", [1, 3])
def test_func_raises(row, split_axis, in_flight):
    data = rows_data(ROWS, COLS)  # failing_at(row) raises in the sub-chunk holding `row`
    x = da.from_array(data, chunks=(CHUNK, COLS))
    y = dask_overlap.map_blocks(
        failing_at(row),
        x,
        split_axis=split_axis,
        sub_chunk_bytes=COLS * 8,  # one row per sub-chunk
        in_flight=in_flight,
        dtype=x.dtype,
    )
    with pytest.raises(Boom) as info:
        y.compute()
    assert type(info.value) is Boom
    assert str(info.value) == f"row {row} is cursed"
    del info  # its traceback holds the frames that hold the other partitions' results
    stats = wait_until_idle()
    assert stats["partitions_failed"] == 1
    assert stats["in_flight"] == 0
    assert stats["device_bytes_in_use"] == 0
    assert pinned_in_use_once_collected() == 0
    # the runtime is still good
    z = dask_overlap.map_blocks(
        lambda b: b * 2, x, split_axis=split_axis, sub_chunk_bytes=COLS * 8, in_flight=in_flight
    )
    np.testing.assert_array_equal(z.compute(), data * 2)
    stats = wait_until_idle()
    assert stats["partitions_failed"] == 1
    assert stats["in_flight"] == 0


@pytest.mark.timeout(60)
def test_every_partition_raises():
    x = da.ones((12, 3), chunks=(2, 3))

    def always(b):
        raise KeyError("nope")

    y = dask_overlap.map_blocks(always, x, split_axis=0, sub_chunk_bytes=1, dtype=float)
    with pytest.raises(KeyError, match="nope"):
        y.compute()
    # (nothing here keeps the exception: its traceback would hold finished results)
    stats = wait_until_idle()
    assert 1 <= stats["partitions_failed"] <= x.npartitions
    assert stats["in_flight"] == 0 and stats["device_bytes_in_use"] == 0
    assert pinned_in_use_once_collected() == 0


def test_delayed_argument_without_dtype_asks_for_dtype():
    x = da.ones((10,), chunks=5)
    scale = dask.delayed(np.float64)(2.0)
    with pytest.raises(TypeError, match=r"dtype must be given .*dask\.delayed.*got dtype=None"):
        dask_overlap.map_blocks(lambda b, c: b * c, x, scale)
    y = dask_overlap.map_blocks(lambda b, c: b * c, x, scale, dtype=np.float64)
    np.testing.assert_array_equal(y.compute(), np.full(10, 2.0))
    # A keyword too: it was inferred as object, and refused as the output's dtype.
    with pytest.raises(TypeError, match=r"dtype must be given .*dask\.delayed.*got dtype=None"):
        dask_overlap.map_blocks(lambda b, c: b * c, x, c=scale)


@pytest.mark.parametrize(
    "kwargs, error, fragments",
    [
        ({"drop_axis": "a"}, TypeError, ["drop_axis", "integer", "got 'a'"]),
        ({"drop_axis": 1.5}, TypeError, ["drop_axis", "got 1.5"]),
        ({"drop_axis": [None]}, TypeError, ["drop_axis", "got [None]"]),
        ({"new_axis": [0.5]}, TypeError, ["new_axis", "got [0.5]"]),
        ({"drop_axis": 5, "split_axis": 1}, ValueError, ["drop_axis", "[-2, 2)", "got 5"]),
        ({"new_axis": 5}, ValueError, ["new_axis", "output (3 dimension(s))", "got 5"]),
        ({"chunks": (2,)}, ValueError, ["Provided chunks have 1 dims; expected 2 dims"]),
        ({"dtype": "U3"}, TypeError, ["dtype must have a numeric or boolean dtype", "<U3"]),
        ({"dtype": object}, TypeError, ["dtype must have a numeric", "object"]),
    ],
)
def test_axes_chunks_and_dtype_are_checked_before_func_is_called(x, kwargs, error, fragments):
    called = []

    def func(b):
        called.append(b.shape)  # (Dask's meta inference calls func on empty blocks)
        return b

    with raises_at_construction(error, *fragments):
        dask_overlap.map_blocks(func, x, **kwargs)
    assert called == []
