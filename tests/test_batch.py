"""``map_blocks(..., batch=k)``: k blocks along ``split_axis`` joined into one partition."""

from __future__ import annotations

from typing import Any

import dask
import dask.array as da
import numpy as np
import pytest
from support import compute_on_two_worker_processes, wait_until_idle

import dask_overlap
from dask_overlap.pipeline.layout import along
from dask_overlap.pipeline.pieces import Pieces, PinnedBlocks


def grid(rows: int = 100, cols: int = 8) -> np.ndarray:
    return np.arange(rows * cols, dtype=np.float64).reshape(rows, cols)


@pytest.mark.parametrize(
    "axis, batch, chunks, expected",
    [
        (0, 3, (10, 4), ((30, 30, 30, 10), (4, 4))),  # the last partition is short
        (1, 2, (10, 4), ((10,) * 10, (8,))),
        (0, 50, (10, 4), ((100,), (4, 4))),  # more than there are: one partition
        (0, 1, (10, 4), ((10,) * 10, (4, 4))),  # 1: the blocks as they are
    ],
)
def test_blocks_are_joined_along_the_split_axis(axis, batch, chunks, expected):
    a = grid()
    x = da.from_array(a, chunks=chunks)
    y = dask_overlap.map_blocks(lambda b: b * 2 + 1, x, split_axis=axis, batch=batch)
    assert y.chunks == expected
    np.testing.assert_array_equal(y.compute(), a * 2 + 1)
    stats = wait_until_idle()
    assert stats["partitions"] == y.npartitions
    assert stats["partitions_failed"] == 0 and stats["pinned_bytes_in_use"] == 0


@pytest.mark.parametrize("backend", ["timed", "host"])
def test_joined_blocks_are_counted_as_staged_and_go_through_the_pinned_pool(backend):
    """Joined blocks go to the pinned pool where the device has memory of its own (the
    timed backend models one); on the host backend, whose device memory is host memory,
    pinned memory would serve nothing: they are joined in ordinary memory."""
    a = grid()
    # Blocks of their own (not views of a), made before: a "+ 0" in the graph would be
    # fused into the partitions, which would then join views of a.
    x = (da.from_array(a, chunks=(10, 8)) + 0).persist()
    seen: list[tuple[int, ...]] = []

    def f(b: Any) -> Any:
        if b.size:  # (not the call on empty blocks that infers the meta)
            seen.append(b.shape)
        return -b

    with dask.config.set({"overlap.backend": backend}):
        y = dask_overlap.map_blocks(f, x, split_axis=0, batch=4, dtype=a.dtype)
        np.testing.assert_array_equal(y.compute(scheduler="sync"), -a)
    assert sorted(seen) == [(20, 8), (40, 8), (40, 8)]  # func sees the joined blocks
    stats = wait_until_idle()
    # Two partitions of 4 blocks and one of 2 (all joined: nothing else is staged here).
    assert stats["bytes_staged"] == a.nbytes
    if backend == "timed":
        assert stats["pinned_bytes_peak"] >= 40 * 8 * 8  # a joined input in the pool
    else:
        assert stats["pinned_bytes_peak"] == 0
    assert stats["pinned_bytes_in_use"] == 0 and stats["pinned_fallbacks"] == 0


def test_a_pool_too_small_for_the_join_uses_ordinary_memory():
    a = grid()
    with dask.config.set({"overlap.pinned-pool-size": "1KiB"}):
        x = da.from_array(a, chunks=(10, 8))
        y = dask_overlap.map_blocks(np.negative, x, split_axis=0, batch=5)
        np.testing.assert_array_equal(y.compute(), -a)
    stats = wait_until_idle()
    assert stats["partitions"] == 2 and stats["partitions_failed"] == 0
    assert stats["pinned_bytes_in_use"] == 0


def test_several_arrays_a_broadcast_one_and_constants_are_joined_alike():
    a = grid(60, 6)
    b = grid(60, 6)[::-1].copy()
    row = np.arange(6.0)  # no split axis: the same block for every partition
    x = da.from_array(a, chunks=(10, 3))
    y = da.from_array(b, chunks=(10, 3))
    r = da.from_array(row, chunks=3)

    def combine(p: Any, q: Any, s: Any, scale: float) -> Any:
        return p * scale + q - s

    got = dask_overlap.map_blocks(combine, x, y, r, 0.5, split_axis=0, batch=4)
    assert got.chunks == ((40, 20), (3, 3))
    np.testing.assert_array_equal(got.compute(), a * 0.5 + b - row)


def test_block_info_describes_the_joined_blocks():
    a = grid(60, 4)
    x = da.from_array(a, chunks=(10, 4))
    got: dict = {}

    def f(b: Any, block_info: dict | None = None) -> Any:
        info = block_info[0]
        got[info["chunk-location"]] = (info["array-location"], b.shape)
        return b

    y = dask_overlap.map_blocks(f, x, split_axis=0, batch=4, dtype=a.dtype)
    y.compute(scheduler="sync")
    assert got == {(0, 0): ([(0, 40), (0, 4)], (40, 4)), (1, 0): ([(40, 60), (0, 4)], (20, 4))}


@pytest.mark.parametrize("out", ["host", "pinned", "device"])
def test_every_out_mode_and_sub_chunks_inside_a_joined_partition(out):
    a = grid(120, 4)
    x = da.from_array(a, chunks=(10, 4))
    y = dask_overlap.map_blocks(
        np.sqrt, x, split_axis=0, batch=6, out=out, sub_chunk_bytes=8 * 4 * 20
    )
    np.testing.assert_array_equal(y.compute(), np.sqrt(a))
    stats = wait_until_idle()
    assert stats["partitions"] == 2 and stats["sub_chunks"] == 2 * 3  # 60 rows in 20s


@pytest.mark.parametrize(
    "kwargs, error, words",
    [
        ({"batch": 0}, ValueError, "batch must be at least 1"),
        ({"batch": 2.0}, TypeError, "batch must be a positive integer or .auto., got 2.0"),
        ({"batch": True}, TypeError, "batch must be a positive integer or .auto., got True"),
        ({"batch": 2}, ValueError, "needs split_axis"),
        ({"batch": 2, "split_axis": 0, "chunks": (10, 8)}, ValueError, "leave chunks out"),
        ({"batch": 2, "split_axis": 0, "drop_axis": 1}, ValueError, "drop_axis=1"),
    ],
)
def test_bad_batch_is_refused_before_func_runs(kwargs, error, words):
    calls: list[int] = []

    def f(b: Any) -> Any:
        calls.append(1)
        return b

    x = da.from_array(grid(), chunks=(10, 8))
    with pytest.raises(error, match=words):
        dask_overlap.map_blocks(f, x, **kwargs)
    assert calls == []


def test_a_subclass_block_in_a_batch_is_refused_by_name():
    a = grid(40, 4) - 400
    # The meta says plain ndarray; the blocks are masked arrays.
    x = da.from_array(a, chunks=(10, 4)).map_blocks(
        np.ma.masked_less, 0, meta=np.empty((0, 0), a.dtype)
    )
    y = dask_overlap.map_blocks(np.negative, x, split_axis=0, batch=2, dtype=a.dtype)
    with pytest.raises(TypeError, match=r"partition .* got a block that is"):
        y.compute(scheduler="sync")
    stats = wait_until_idle()
    assert stats["pinned_bytes_in_use"] == 0


def test_pieces_pickle_with_their_blocks():
    import pickle

    p = Pieces(1, (np.ones((2, 3)), np.zeros((2, 1))))
    q = pickle.loads(pickle.dumps(p))
    assert q.axis == 1 and [b.tolist() for b in q.blocks] == [b.tolist() for b in p.blocks]


@pytest.mark.parametrize(
    "axis, chunks, sub_rows",
    [
        (0, (10, 10), None),  # one sub-chunk a partition
        (0, (10, 10), 7),  # sub-chunks that straddle the blocks
        (1, (100, 1), None),  # every block's part is rows of the join
        (1, (100, 1), 3),
    ],
)
def test_pinned_blocks_are_copied_in_one_by_one_and_not_joined_on_the_host(axis, chunks, sub_rows):
    a = grid(100, 10)  # ten blocks along either axis: batches of 4, 4 and 2
    # A first stage whose result blocks stay in the pinned pool (out="pinned").
    (x,) = dask.persist(
        dask_overlap.map_blocks(lambda b: b + 1, da.from_array(a, chunks=chunks), out="pinned")
    )
    before = wait_until_idle()
    row = a.nbytes // a.shape[axis]
    sub = "auto" if sub_rows is None else sub_rows * row
    seen: list[tuple[int, ...]] = []

    def f(b: Any) -> Any:
        if b.size:  # (not the call on empty blocks that infers the meta)
            seen.append(b.shape)
        return b * 2

    y = dask_overlap.map_blocks(f, x, split_axis=axis, batch=4, sub_chunk_bytes=sub, dtype=a.dtype)
    np.testing.assert_array_equal(y.compute(scheduler="sync"), (a + 1) * 2)
    after = wait_until_idle()
    moved = {k: after[k] - before[k] for k in ("partitions", "bytes_staged", "bytes_h2d")}
    # Nothing joined or staged on the host: every byte went to the device straight from
    # the blocks it was in.
    assert moved == {"partitions": 3, "bytes_staged": 0, "bytes_h2d": a.nbytes}
    assert after["pinned_fallbacks"] == 0
    extents = [s[axis] for s in seen]
    joined = [n * a.shape[axis] // 10 for n in (4, 4, 2)]
    if sub_rows is None:
        assert sorted(extents) == sorted(joined)  # func sees each batch's join
    else:  # cut into sub-chunks of at most sub_rows, some straddling two blocks
        assert sum(extents) == a.shape[axis] and max(extents) <= sub_rows
        assert len(extents) == sum(-(-n // sub_rows) for n in joined)


def test_pinned_and_pageable_blocks_in_one_batch_are_joined_on_the_host():
    a = grid()
    (pinned,) = dask.persist(
        dask_overlap.map_blocks(np.negative, da.from_array(a[:50], chunks=(10, 8)), out="pinned")
    )
    x = da.concatenate([pinned, da.from_array(a[50:], chunks=(10, 8)) + 0])
    before = wait_until_idle()
    y = dask_overlap.map_blocks(lambda b: b * 3, x, split_axis=0, batch=4)
    np.testing.assert_array_equal(y.compute(), np.concatenate([-a[:50], a[50:]]) * 3)
    after = wait_until_idle()
    # Blocks 0-3 pinned (copied in one by one), 4-7 and 8-9 mixed or pageable (joined).
    assert after["bytes_staged"] - before["bytes_staged"] == a.nbytes * 6 // 10


def test_pinned_blocks_stand_for_their_join():
    blocks = (np.arange(6.0).reshape(2, 3), np.arange(6.0, 15.0).reshape(3, 3))
    p = PinnedBlocks.of(0, blocks)
    assert (p.shape, p.nbytes, p.ndim, p.size, p.row_bytes) == ((5, 3), 120, 2, 15, 24)
    part = p[along(0, 1, 4)]  # as a layout cuts a sub-chunk
    assert part.shape == (3, 3)
    assert [(lo, hi, at) for _, lo, hi, at in part.parts()] == [(1, 2, 0), (0, 2, 1)]
    np.testing.assert_array_equal(np.concatenate(part.views()), np.arange(3.0, 12.0).reshape(3, 3))
    assert p[along(0, 4, 9)].shape == (1, 3) and p[along(0, 2, 2)].parts() == []
    with pytest.raises(TypeError, match="cut along their axis only"):
        p[along(1, 1, 2)]


@pytest.mark.timeout(120)
def test_batches_across_worker_processes():
    a = grid(200, 16)
    x = da.from_array(a, chunks=(10, 8))
    y = dask_overlap.map_blocks(lambda b: b - 1, x, split_axis=0, batch=4)
    got, per_worker = compute_on_two_worker_processes(y)
    np.testing.assert_array_equal(got, a - 1)
    assert sum(s["partitions"] for s in per_worker.values()) == y.npartitions == 5 * 2
    assert sum(s["bytes_staged"] for s in per_worker.values()) == a.nbytes


def test_a_lower_dimensional_array_is_joined_along_its_own_axis():
    """With split_axis=1 on 2-D blocks, a 1-D array lines up with axis 1 (Dask's
    broadcasting from the right), so its blocks are joined along its axis 0."""
    a = grid(6, 40)
    w = np.arange(40.0)
    x = da.from_array(a, chunks=(6, 5))
    v = da.from_array(w, chunks=5)
    y = dask_overlap.map_blocks(lambda p, q: p * q, x, v, split_axis=1, batch=3)
    assert y.chunks == ((6,), (15, 15, 10))
    np.testing.assert_array_equal(y.compute(), a * w)


def test_new_axis_with_the_batch_along_a_kept_axis():
    a = grid(60, 4)
    x = da.from_array(a, chunks=(10, 4))
    y = dask_overlap.map_blocks(lambda b: b[:, None, :], x, split_axis=0, batch=4, new_axis=1)
    assert y.chunks == ((40, 20), (1,), (4,))
    np.testing.assert_array_equal(y.compute(), a[:, None, :])


def test_unknown_chunk_sizes_and_a_broadcast_row_along_the_split_axis():
    a = np.random.default_rng(0).standard_normal((100, 4))
    x = da.from_array(a, chunks=(10, 4))
    kept = x[x[:, 0] > 0]  # extents along axis 0 unknown until computed
    y = dask_overlap.map_blocks(np.negative, kept, split_axis=0, batch=3)
    assert y.numblocks == (4, 1)
    np.testing.assert_array_equal(y.compute(), -a[a[:, 0] > 0])
    row = da.from_array(a[:1], chunks=(1, 4))  # one block of one row: broadcast, not joined
    z = dask_overlap.map_blocks(lambda p, q: p + q, x, row, split_axis=0, batch=3)
    assert z.chunks == ((30, 30, 30, 10), (4,))
    np.testing.assert_array_equal(z.compute(), a + a[:1])
