"""``dask_overlap.map_blocks`` gives what ``dask.array.map_blocks`` gives (host backend)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import dask
import dask.array as da
import numpy as np
import pytest
from dask.utils import parse_bytes
from support import compute_on_two_worker_processes

import dask_overlap
from dask_overlap.pipeline.engine import plan_sub_chunks

DTYPES = [
    np.float32,
    np.float64,
    np.int8,
    np.int32,
    np.int64,
    np.uint8,
    np.uint16,
    np.uint64,
    np.bool_,
    np.complex64,
    np.complex128,
]

# uneven chunks in every dimension, 1-D to 4-D
SHAPES = {
    1: ((23,), ((7, 7, 7, 2),)),
    2: ((11, 9), ((4, 4, 3), (5, 4))),
    3: ((7, 6, 5), ((3, 4), (2, 2, 2), (5,))),
    4: ((5, 4, 6, 3), ((2, 3), (3, 1), (4, 2), (2, 1))),
}


def random_array(shape, dtype, seed=0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    dtype = np.dtype(dtype)
    if dtype.kind == "b":
        return rng.random(shape) < 0.5
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        return rng.integers(info.min, info.max, size=shape, dtype=dtype, endpoint=True)
    if dtype.kind == "c":
        return (rng.standard_normal(shape) + 1j * rng.standard_normal(shape)).astype(dtype)
    return rng.standard_normal(shape).astype(dtype)


def dask_array(ndim, dtype, seed=0) -> da.Array:
    shape, chunks = SHAPES[ndim]
    return da.from_array(random_array(shape, dtype, seed), chunks=chunks)


def assert_same_array(ours: da.Array, theirs: da.Array) -> None:
    """Same metadata and the same values, bit for bit (NaN and signed zeros included)."""
    assert ours.shape == theirs.shape
    assert ours.chunks == theirs.chunks
    assert ours.dtype == theirs.dtype
    assert type(ours._meta) is type(theirs._meta)
    assert ours._meta.dtype == theirs._meta.dtype
    assert ours._meta.ndim == theirs._meta.ndim
    a, b = dask.compute(ours, theirs)
    assert a.dtype == b.dtype and a.shape == b.shape
    assert a.tobytes() == b.tobytes()


def twice_plus_one(b):
    return b * 2 + 1


def invert(b):
    return ~b


def stats():
    return dask_overlap.runtime_stats()


# -- dtypes and dimensions --------------------------------------------------------------
@pytest.mark.parametrize("ndim", [1, 2, 3, 4])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_same_as_dask_across_dtypes_and_ndims(ndim, dtype):
    x = dask_array(ndim, dtype)
    func = invert if np.dtype(dtype).kind in "biu" else twice_plus_one
    assert_same_array(dask_overlap.map_blocks(func, x), da.map_blocks(func, x))
    s = stats()
    assert s["backend"] == "host"
    assert s["partitions"] == x.npartitions
    assert s["sub_chunks"] == x.npartitions


@pytest.mark.parametrize(
    "dtype", [np.float32, np.int16, np.bool_, np.complex128], ids=lambda d: np.dtype(d).name
)
@pytest.mark.parametrize(
    "ndim, axis", [(n, k) for n in SHAPES for k in range(n)] + [(3, -1), (4, -4)]
)
@pytest.mark.parametrize("in_flight", [1, 3])
def test_split_axis_with_many_sub_chunks(ndim, axis, dtype, in_flight):
    x = dask_array(ndim, dtype, seed=ndim)
    func = invert if np.dtype(dtype).kind in "biu" else twice_plus_one
    y = dask_overlap.map_blocks(
        func, x, split_axis=axis, batch=1, sub_chunk_bytes=1, in_flight=in_flight
    )
    assert_same_array(y, da.map_blocks(func, x))
    s = stats()
    # sub_chunk_bytes=1: one index along the split axis per sub-chunk
    axis %= ndim
    assert s["sub_chunks"] == x.shape[axis] * (x.npartitions // x.numblocks[axis])
    assert s["max_window"] == min(in_flight, max(x.chunks[axis]))
    assert s["in_flight"] == 0


@pytest.mark.parametrize("in_flight", [1, 2, 4, 8, 64])
@pytest.mark.parametrize("sub_chunk_bytes", [1, 100, "1KiB", 10**9])
def test_in_flight_and_sub_chunk_bytes_do_not_change_the_result(in_flight, sub_chunk_bytes):
    x = da.from_array(random_array((40, 17), np.float64, 3), chunks=(13, 17))
    y = dask_overlap.map_blocks(
        np.sin, x, split_axis=0, sub_chunk_bytes=sub_chunk_bytes, in_flight=in_flight
    )
    assert_same_array(y, da.map_blocks(np.sin, x))
    nbytes = parse_bytes(sub_chunk_bytes)
    expected = sum(len(plan_sub_chunks(rows, 17 * 8, nbytes, 0)) for rows in x.chunks[0])
    s = stats()
    assert s["sub_chunks"] == expected
    assert s["max_window"] == min(in_flight, len(plan_sub_chunks(13, 17 * 8, nbytes, 0)))


@pytest.mark.parametrize("split_axis", [None, 0, 1])
def test_out_device_equals_out_host(split_axis):
    """On the host path the "device" arrays are NumPy: the same values, no pinned output."""
    x = da.from_array(random_array((40, 18), np.float64, 5), chunks=(13, 9))
    y = dask_overlap.map_blocks(
        twice_plus_one, x, split_axis=split_axis, sub_chunk_bytes=16, out="device"
    )
    assert y.name != dask_overlap.map_blocks(twice_plus_one, x, split_axis=split_axis).name
    assert_same_array(y, da.map_blocks(twice_plus_one, x))
    s = stats()
    assert s["bytes_d2h"] == 0 and s["pinned_bytes_peak"] <= s["bytes_h2d"] and s["in_flight"] == 0


# -- the window in a real run -----------------------------------------------------------
@pytest.mark.timeout(60)
@pytest.mark.parametrize("window", [1, 2, 3])
def test_runner_reaches_but_never_exceeds_the_window(window, monkeypatch):
    """Count sub-chunks between the start of their copy-in and the end of their copy-out.

    That span lies inside a sub-chunk's time in flight, so the count must stay within
    the window. Computes are held until the count reaches the window (or a timeout), so
    the runner must admit and copy in ``window`` sub-chunks at once to get past them
    quickly (the runtime's streams outnumber the window, so none queues behind another).
    """
    settings = dask.config.set({"overlap.streams": 4})  # in force until the end
    rt = dask_overlap.get_runtime("host")
    backend = rt.backend
    lock = threading.Lock()
    live = {"now": 0, "max": 0}
    full = threading.Event()
    real_copy_in, real_copy_out = backend.copy_in, backend.copy_out

    def copy_in(stream, host):
        with lock:
            live["now"] += 1
            live["max"] = max(live["max"], live["now"])
            if live["now"] == window:
                full.set()
        return real_copy_in(stream, host)

    def copy_out(stream, device, out):
        real_copy_out(stream, device, out)
        with lock:
            live["now"] -= 1

    monkeypatch.setattr(backend, "copy_in", copy_in)
    monkeypatch.setattr(backend, "copy_out", copy_out)
    calls = []
    waited = []

    def func(b):
        calls.append(len(calls))
        if not full.is_set():
            waited.append(full.wait(timeout=10))
        return b + 1

    x = da.from_array(np.arange(64.0).reshape(16, 4), chunks=(16, 4))  # one partition
    y = dask_overlap.map_blocks(
        func, x, split_axis=0, sub_chunk_bytes=32, in_flight=window, dtype=x.dtype, meta=x._meta
    )
    np.testing.assert_array_equal(y.compute(), np.arange(64.0).reshape(16, 4) + 1)
    assert len(calls) == 16
    assert full.is_set() and all(waited)  # no compute gave up waiting
    assert live["max"] == window
    assert live["now"] == 0
    s = stats()
    assert s["max_window"] == window
    assert s["in_flight"] == 0
    settings.__exit__(None, None, None)


# -- several inputs, broadcasting, alignment by block position --------------------------
@pytest.mark.parametrize("split_axis", [None, 0, 1, 2, -1])
def test_several_inputs_with_broadcasting(split_axis):
    a = da.from_array(random_array((8, 6, 5), np.float64, 1), chunks=(3, 2, 5))
    b = da.from_array(random_array((5,), np.float32, 2), chunks=5)  # along the last axis
    c = da.from_array(random_array((1, 6, 1), np.int32, 3), chunks=(1, 2, 1))
    d = da.from_array(np.float64(2.5))  # 0-d

    def f(u, v, w, s):
        return u * v - w + s

    y = dask_overlap.map_blocks(f, a, b, c, d, split_axis=split_axis, sub_chunk_bytes=16)
    assert_same_array(y, da.map_blocks(f, a, b, c, d))
    if split_axis is not None:
        assert stats()["sub_chunks"] > a.npartitions


def test_alignment_by_block_position_as_dask_does():
    """Dask's own example: same numblocks, different shapes and chunks."""
    x = da.arange(1000, chunks=(100,))
    y = da.arange(100, chunks=(10,))

    def f(a, b):
        return np.array([a.max(), b.max()])

    assert_same_array(
        dask_overlap.map_blocks(f, x, y, chunks=(2,), dtype="i8"),
        da.map_blocks(f, x, y, chunks=(2,), dtype="i8"),
    )


@pytest.mark.parametrize("split_axis", [None, 0])
def test_different_chunkings_aligned_by_position_with_split(split_axis):
    a = da.from_array(random_array((8, 6), np.float64, 4), chunks=(4, 3))
    b = da.from_array(random_array((8, 4), np.float64, 5), chunks=(4, 2))
    assert a.numblocks == b.numblocks and a.chunks != b.chunks

    def glue(u, v):
        return np.concatenate([u, v * 2], axis=1)

    kwargs = dict(chunks=((4, 4), (5, 5)), dtype=np.float64)
    y = dask_overlap.map_blocks(glue, a, b, split_axis=split_axis, sub_chunk_bytes=1, **kwargs)
    assert_same_array(y, da.map_blocks(glue, a, b, **kwargs))


# -- constants, delayed objects, keyword arguments --------------------------------------
def affine(b, scale, offset, *, power=1, table=None):
    return (b * scale + offset) ** power + table.sum()


@pytest.mark.parametrize("split_axis", [None, 1])
def test_constants_delayed_and_kwargs_pass_through(split_axis):
    x = dask_array(2, np.float64, 7)
    table = np.arange(5.0)
    offset = dask.delayed(np.float64)(0.25)  # computed, then passed whole to each task
    ours = dask_overlap.map_blocks(
        affine,
        x,
        3.0,
        offset,
        power=2,
        table=table,
        dtype=np.float64,
        split_axis=split_axis,
        sub_chunk_bytes=8,
    )
    theirs = da.map_blocks(affine, x, 3.0, offset, power=2, table=table, dtype=np.float64)
    assert_same_array(ours, theirs)


def test_kwargs_change_the_result_and_the_name():
    x = dask_array(1, np.float64)
    f = lambda b, k=1: b * k  # noqa: E731
    y2 = dask_overlap.map_blocks(f, x, k=2)
    y3 = dask_overlap.map_blocks(f, x, k=3)
    assert y2.name != y3.name
    np.testing.assert_array_equal(y3.compute(), x.compute() * 3)


def test_no_array_only_chunks():
    def f(block_id=None):
        return np.full((2, 3), block_id[0] * 10 + block_id[1], dtype=np.int64)

    kwargs = dict(chunks=((2, 2, 2), (3, 3)), dtype=np.int64)
    assert_same_array(dask_overlap.map_blocks(f, **kwargs), da.map_blocks(f, **kwargs))


# -- block_info and block_id ------------------------------------------------------------
class Recorder:
    """Record what a block function was given (tasks run in this process)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.calls: list[tuple] = []

    def __call__(self, a, b, block_info=None, block_id=None):
        if isinstance(block_id, tuple):  # not Dask's meta inference (which passes stand-ins)
            with self.lock:
                self.calls.append((block_id, block_info, a.shape))
        return a + b


def location(info) -> tuple:
    return info[None]["chunk-location"]


@pytest.mark.parametrize("drop", [False, True])
def test_block_info_and_block_id_equal_dask(drop):
    a = da.from_array(random_array((9, 8), np.float64, 8), chunks=(4, 3))
    b = da.from_array(random_array((8,), np.float64, 9), chunks=3)
    kwargs = dict(dtype=np.float64)
    if drop:
        # a function that drops axis 1 (Dask then hands it whole blocks along it)
        kwargs.update(drop_axis=1)
        func_ours, func_dask = DropRecorder(), DropRecorder()
    else:
        func_ours, func_dask = Recorder(), Recorder()
    ours = dask_overlap.map_blocks(func_ours, a, b, **kwargs)
    theirs = da.map_blocks(func_dask, a, b, **kwargs)
    assert_same_array(ours, theirs)
    got = {bid: info for bid, info, _ in func_ours.calls}
    want = {bid: info for bid, info, _ in func_dask.calls}
    assert len(got) == ours.npartitions
    assert got == want
    assert all(location(info) == bid for bid, info in got.items())


class DropRecorder(Recorder):
    def __call__(self, a, b, block_info=None, block_id=None):
        return super().__call__(a, b, block_info, block_id).sum(axis=1)


@pytest.mark.parametrize("axis", [0, 1])
def test_block_info_is_narrowed_to_each_sub_chunk(axis):
    a = da.from_array(random_array((9, 8), np.float64, 10), chunks=(4, 3))
    b = da.from_array(random_array((8,), np.float64, 11), chunks=3)  # broadcast along 0
    rec, ref = Recorder(), Recorder()
    ours = dask_overlap.map_blocks(rec, a, b, dtype=np.float64, split_axis=axis, sub_chunk_bytes=8)
    theirs = da.map_blocks(ref, a, b, dtype=np.float64)
    assert_same_array(ours, theirs)
    want = {bid: info for bid, info, _ in ref.calls}
    calls = rec.calls
    assert len(calls) > a.npartitions  # several sub-chunks per partition
    by_partition: dict[tuple, list] = {}
    for bid, info, shape in calls:
        by_partition.setdefault(bid, []).append((info, shape))
    assert set(by_partition) == set(want)
    for bid, subs in by_partition.items():
        full = want[bid]
        spans = []
        for info, shape in subs:
            lo, hi = info[None]["array-location"][axis]
            assert hi - lo == shape[axis] == info[None]["chunk-shape"][axis]
            assert info[0]["array-location"][axis] == (lo, hi)
            # inside the partition's own location; everything else is the partition's
            plo, phi = full[None]["array-location"][axis]
            assert plo <= lo < hi <= phi
            for key in ("shape", "num-chunks", "chunk-location"):
                assert info[None][key] == full[None][key]
                assert info[0][key] == full[0][key]
            other = 1 - axis
            assert info[None]["array-location"][other] == full[None]["array-location"][other]
            if axis == 0:  # b is broadcast along axis 0: passed whole, info untouched
                assert info[1] == full[1]
            else:  # b's only axis lines up with a's axis 1: narrowed like a's
                assert info[1]["array-location"][0] == (lo, hi)
            spans.append((lo, hi))
        # the sub-chunks tile the partition exactly
        spans.sort()
        assert spans[0][0] == full[None]["array-location"][axis][0]
        assert spans[-1][1] == full[None]["array-location"][axis][1]
        assert all(p[1] == q[0] for p, q in zip(spans, spans[1:], strict=False))


def test_block_id_alone():
    x = dask_array(3, np.int32)

    def f(b, block_id=None):
        return b + np.int32(100 * block_id[0] + 10 * block_id[1] + block_id[2])

    for split_axis in (None, 2):
        assert_same_array(
            dask_overlap.map_blocks(f, x, split_axis=split_axis, sub_chunk_bytes=1, dtype=x.dtype),
            da.map_blocks(f, x, dtype=x.dtype),
        )


# -- name, token, meta ------------------------------------------------------------------
def test_name_is_the_exact_key_name():
    x = dask_array(2, np.float64)
    y = dask_overlap.map_blocks(twice_plus_one, x, name="my-exact-name")
    assert y.name == "my-exact-name"
    assert {k[0] for k in dask.core.flatten(y.__dask_keys__())} == {"my-exact-name"}
    np.testing.assert_array_equal(y.compute(), x.compute() * 2 + 1)


def test_token_is_the_name_prefix():
    x = dask_array(2, np.float64)
    y = dask_overlap.map_blocks(twice_plus_one, x, token="tok")
    z = da.map_blocks(twice_plus_one, x, token="tok")
    assert y.name.startswith("tok-") and z.name.startswith("tok-")
    assert y.name != dask_overlap.map_blocks(twice_plus_one, x, token="other").name


def test_default_name_is_deterministic_and_per_function():
    x = dask_array(2, np.float64)
    y = dask_overlap.map_blocks(twice_plus_one, x)
    assert y.name.startswith("twice_plus_one-")
    assert da.map_blocks(twice_plus_one, x).name.startswith("twice_plus_one-")
    assert y.name == dask_overlap.map_blocks(twice_plus_one, x).name
    assert y.name != dask_overlap.map_blocks(np.negative, x).name
    assert y.name != dask_overlap.map_blocks(twice_plus_one, x + 1).name


def test_meta_and_dtype_given():
    x = dask_array(2, np.float32)
    meta = np.empty((0, 0), dtype=np.float64)
    ours = dask_overlap.map_blocks(lambda b: b.astype(np.float64), x, meta=meta)
    theirs = da.map_blocks(lambda b: b.astype(np.float64), x, meta=meta)
    assert_same_array(ours, theirs)
    ours = dask_overlap.map_blocks(lambda b: b.astype(np.int16), x, dtype=np.int16)
    theirs = da.map_blocks(lambda b: b.astype(np.int16), x, dtype=np.int16)
    assert_same_array(ours, theirs)


def test_meta_inferred_like_dask():
    x = dask_array(3, np.int32)
    f = lambda b: (b > 0).astype(np.uint8)  # noqa: E731
    ours, theirs = dask_overlap.map_blocks(f, x), da.map_blocks(f, x)
    assert ours.dtype == theirs.dtype == np.uint8
    assert_same_array(ours, theirs)


# -- drop_axis, new_axis ----------------------------------------------------------------
@pytest.mark.parametrize("split_axis", [None, 0, 2])
def test_drop_axis(split_axis):
    x = dask_array(3, np.float64, 12)
    # Dask concatenates a dropped axis into one block; the function reduces it (max: exact
    # whatever the memory layout of a sub-chunk, unlike a floating-point sum)
    f = lambda b: b.max(axis=1)  # noqa: E731
    ours = dask_overlap.map_blocks(f, x, drop_axis=1, split_axis=split_axis, sub_chunk_bytes=1)
    assert_same_array(ours, da.map_blocks(f, x, drop_axis=1))


@pytest.mark.parametrize("split_axis", [None, 0, 1, -1])
def test_new_axis(split_axis):
    x = dask_array(2, np.float64, 13)
    f = lambda b: np.stack([b, -b], axis=1)  # noqa: E731
    kwargs = dict(new_axis=1, chunks=(x.chunks[0], (2,), x.chunks[1]))
    ours = dask_overlap.map_blocks(f, x, split_axis=split_axis, sub_chunk_bytes=1, **kwargs)
    assert_same_array(ours, da.map_blocks(f, x, **kwargs))


def test_drop_axis_and_new_axis_together():
    x = dask_array(2, np.float64, 14).rechunk({0: -1})
    f = lambda b: b.max(axis=0)[None, :]  # noqa: E731
    kwargs = dict(drop_axis=0, new_axis=0, chunks=((1,), x.chunks[1]))
    for split_axis in (None, 1):
        ours = dask_overlap.map_blocks(f, x, split_axis=split_axis, sub_chunk_bytes=1, **kwargs)
        assert_same_array(ours, da.map_blocks(f, x, **kwargs))


# -- a real cluster ---------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.timeout(120)
def test_local_cluster_processes():
    x = da.from_array(random_array((64, 32), np.float32, 15), chunks=(16, 32))
    y = dask_overlap.map_blocks(twice_plus_one, x, split_axis=0, sub_chunk_bytes=512)
    expected = da.map_blocks(twice_plus_one, x).compute()
    got, per_worker = compute_on_two_worker_processes(y)
    assert got.tobytes() == expected.tobytes()
    assert sum(s["partitions"] for s in per_worker.values()) == x.npartitions
    assert sum(s["sub_chunks"] for s in per_worker.values()) == 4 * x.npartitions
    assert all(s["in_flight"] == 0 and s["partitions_active"] == 0 for s in per_worker.values())


@pytest.mark.parametrize("split_axis", [None, 0])
def test_enforce_ndim_has_dasks_meaning(split_axis):
    """Accepted, never handed to ``func`` (not in dtype inference either), and a block of
    the wrong dimension fails as Dask's does."""
    a = np.arange(48.0).reshape(8, 6)
    x = da.from_array(a, chunks=(4, 3))
    ours = dask_overlap.map_blocks(np.sqrt, x, enforce_ndim=True, split_axis=split_axis)
    theirs = da.map_blocks(np.sqrt, x, enforce_ndim=True)
    np.testing.assert_array_equal(ours.compute(), theirs.compute())
    flat = dask_overlap.map_blocks(np.ravel, x, dtype=float, enforce_ndim=True)
    with pytest.raises(ValueError, match="shape"):
        flat.compute()
    # As in Dask, True and False name different arrays (Dask wraps func when True).
    loose = dask_overlap.map_blocks(np.sqrt, x, enforce_ndim=False, split_axis=split_axis)
    assert ours.name != loose.name
    assert (
        ours.name
        == dask_overlap.map_blocks(np.sqrt, x, enforce_ndim=True, split_axis=split_axis).name
    )
    np.testing.assert_array_equal(loose.compute(), theirs.compute())


# -- realistic workloads, against Dask's own map_blocks (#13) -----------------------------
def _gaussian(b):
    from scipy import ndimage

    return ndimage.gaussian_filter(b, sigma=1.5, mode="nearest")


def _spectrum(b):
    return np.abs(np.fft.rfft(b, axis=-1)).astype(np.float32)


def _row_energy(b):
    return (b.astype(np.float64) ** 2).sum(axis=1)


def _weighted(b, w, offset):
    return b * w + offset


WORKLOADS = {
    # name: (func, arrays builder, map_blocks keywords, split_axis)
    "gaussian-filter": (_gaussian, lambda a: [a], {}, None),
    "fft-spectrum": (_spectrum, lambda a: [a], {"dtype": np.float32, "chunks": (100, 33)}, 0),
    "row-energy-drop-axis": (_row_energy, lambda a: [a], {"drop_axis": 1, "dtype": float}, 0),
    "new-axis": (lambda b: b[:, None, :], lambda a: [a], {"new_axis": 1}, 0),
    "broadcast-inputs": (_weighted, lambda a: [a, a[:1], np.float32(3)], {}, 0),
    "big-endian": (np.sqrt, lambda a: [np.abs(a).astype(">f8")], {}, 0),
    "strided": (np.negative, lambda a: [a[:, ::2]], {}, 1),
}


@pytest.mark.parametrize("name", list(WORKLOADS))
def test_realistic_workloads_equal_dask(name):
    func, build, keywords, split_axis = WORKLOADS[name]
    a = np.random.default_rng(7).standard_normal((400, 64)).astype(np.float32)
    args = [
        da.from_array(v, chunks=(100, -1)) if isinstance(v, np.ndarray) and v.ndim else v
        for v in build(a)
    ]
    ours = dask_overlap.map_blocks(func, *args, split_axis=split_axis, **keywords)
    theirs = da.map_blocks(func, *args, **keywords)
    got, expected = dask.compute(ours, theirs)
    assert got.dtype == expected.dtype and got.shape == expected.shape
    if name == "gaussian-filter":  # the same values over the same blocks
        np.testing.assert_array_equal(got, expected)
    else:
        np.testing.assert_allclose(got, expected, rtol=1e-6)


def test_zero_length_chunks_and_chained_device_outputs():
    a = np.arange(60.0).reshape(12, 5)
    x = da.from_array(a, chunks=((0, 4, 0, 8), 5))
    first = dask_overlap.map_blocks(lambda b: b * 2, x, out="device", split_axis=0)
    second = dask_overlap.map_blocks(lambda b: b + 1, first, split_axis=0)
    np.testing.assert_array_equal(second.compute(), a * 2 + 1)


def test_cupy_kernels_are_kept_only_while_dask_overlap_pickles() -> None:
    """The __main__ kernel guard (backends/kernel_pickling.py) is scoped: with a stand-in
    CuPy whose kernels count their copies, building the graph, tokenizing, pickling and
    copying a partition task make no copy of a kernel func closes over, nor of a CuPy ufunc
    given as func (which pickles by name), and ``copyreg`` is left as it was (Dask's own
    tokenize, outside, still copies: the check has teeth)."""
    script = os.path.join(os.path.dirname(__file__), "kernel_scope_script.py")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    proc = subprocess.run(
        [sys.executable, script], capture_output=True, text=True, env=env, timeout=120
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    got = dict(line.split("=", 1) for line in proc.stdout.split())
    assert got == {
        "copies_while_building": "0",
        "copyreg_after": "False",
        "copies_by_task": "0",
        "same_kernel": "True",
        "copy_shares_func": "True",
        "plain_pickle_copies": "True",
        "copies_by_plain_tokenize": got["copies_by_plain_tokenize"],
        "ufunc_copies": "0",
        "ufunc_by_name": "True",
        "same_ufunc_and_module": "True",
        "copyreg_after_all": "False",
        "ufunc_correct": "True",
        "correct": "True",
    }
    assert int(got["copies_by_plain_tokenize"]) > 0
