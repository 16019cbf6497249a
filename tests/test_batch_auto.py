"""``batch="auto"`` (the default): small blocks joined into partitions of about 64 MiB where
that is sound, and each partition's output cut back into its blocks.

As where a device runs the partitions (``as_on_a_device``): on the host backend alone,
``auto`` joins nothing (tests/test_cpu_path.py)."""

from __future__ import annotations

import threading
from typing import Any

import dask
import dask.array as da
import numpy as np
import pytest
from support import (
    compute_on_two_worker_processes,
    pinned_in_use_once_collected,
    task_prefixes,
    wait_until_idle,
)

import dask_overlap
import dask_overlap.graph.batch

pytestmark = pytest.mark.usefixtures("as_on_a_device")


def grid(rows: int = 120, cols: int = 8) -> np.ndarray:
    return np.arange(rows * cols, dtype=np.float64).reshape(rows, cols)


@pytest.fixture
def batch_bytes(monkeypatch: pytest.MonkeyPatch) -> Any:
    """Sets the size "auto" joins blocks up to (64 MiB; tests use blocks of a few KiB), and
    lets it join down to one partition (it keeps 8 of a small array's)."""
    monkeypatch.setattr(dask_overlap.graph.batch, "AUTO_MIN_PARTITIONS", 1)

    def set_to(nbytes: int) -> None:
        monkeypatch.setattr(dask_overlap.graph.batch, "AUTO_MIN_BYTES", nbytes)

    return set_to


class Calls:
    """``func``'s calls on real blocks (not the ones on empty blocks that infer the meta)."""

    def __init__(self, func: Any):
        self.func = func
        self.shapes: list[tuple[int, ...]] = []
        self.lock = threading.Lock()

    def __call__(self, b: Any) -> Any:
        if b.size:
            with self.lock:
                self.shapes.append(b.shape)
        return self.func(b)


@pytest.mark.parametrize("axis", [0, 1])
def test_small_blocks_are_joined_and_the_output_keeps_their_chunks(axis, batch_bytes):
    a = grid(120, 12)
    x = da.from_array(a, chunks=(10, 12) if axis == 0 else (120, 1))  # 12 blocks of 960 B
    batch_bytes(4 * 960)
    f = Calls(lambda b: b * 2 - 1)
    y = dask_overlap.map_blocks(f, x, split_axis=axis, dtype=a.dtype)
    assert y.chunks == x.chunks
    (done,) = dask.persist(y)
    np.testing.assert_array_equal(done.compute(), a * 2 - 1)
    # Three partitions of four blocks: func saw each batch's join once.
    assert sorted(s[axis] for s in f.shapes) == [40 if axis == 0 else 4] * 3
    stats = wait_until_idle()
    assert stats["partitions"] == 3 and stats["partitions_failed"] == 0
    # Each output block is a view of its partition's output: cut, not copied.
    graph = done.__dask_graph__()
    blocks = [graph[k] for k in dask.core.flatten(done.__dask_keys__())]
    assert len(blocks) == 12 and all(b.base is not None for b in blocks)
    assert len({id(b.base) for b in blocks}) == 3


def optimized(y: da.Array) -> dict:
    """The graph the scheduler is handed for ``y`` (Dask's optimization, ours installed)."""
    return dict(y.__dask_optimize__(y.__dask_graph__(), y.__dask_keys__()))


def test_persisted_blocks_go_into_their_gathers_and_leave_the_graph(batch_bytes):
    """Blocks of data (a persisted array's) that only a batch's gather reads are put into
    the gather: the scheduler is handed no key of theirs to order and keep."""
    a = grid(120, 8)
    (x,) = dask.persist(da.from_array(a, chunks=(10, 8)))  # 12 blocks of data
    batch_bytes(4 * 640)
    y = dask_overlap.map_blocks(lambda b: b * 2, x, split_axis=0, dtype=a.dtype)
    graph = optimized(y)
    assert not [k for k in graph if k[0] == x.name]
    assert len(graph) == 3 + 3 + 12  # the gathers, the partitions, the cut
    np.testing.assert_array_equal(y.compute(), a * 2)
    np.testing.assert_array_equal(dask.persist(y, scheduler="sync")[0].compute(), a * 2)
    # A block that another task reads as well, or that is asked for, stays a key.
    both = da.concatenate([y, x[:10]])
    assert [k for k in optimized(both) if k[0] == x.name] == [(x.name, 0, 0)]
    np.testing.assert_array_equal(both.compute(), np.concatenate([a * 2, a[:10]]))


def test_blocks_go_into_the_gathers_before_dasks_own_optimization(batch_bytes):
    """The blocks a batch gathers are put into it on the layers, before Dask's own passes,
    which then cull and fuse a key a batch rather than a key a block more; blocks that
    another layer reads, or that are asked for, stay where they are."""
    from dask_overlap.graph.batch import with_data_gathered

    a = grid(120, 8)
    (x,) = dask.persist(da.from_array(a, chunks=(10, 8)))
    batch_bytes(4 * 640)
    y = dask_overlap.map_blocks(lambda b: b * 2, x, split_axis=0, dtype=a.dtype)
    g, keys = y.__dask_graph__(), y.__dask_keys__()
    out = with_data_gathered(g, keys)
    assert x.name in g.layers and x.name not in out.layers
    assert x.name not in set().union(*out.dependencies.values())
    gathers = [layer for name, layer in out.layers.items() if name.startswith("overlap-batch")]
    assert [len(layer) for layer in gathers] == [3]
    assert all(not t.dependencies for t in gathers[0].values())
    z = y + x
    assert with_data_gathered(z.__dask_graph__(), z.__dask_keys__()) is z.__dask_graph__()
    assert with_data_gathered(g, [keys, x.__dask_keys__()]) is g
    np.testing.assert_array_equal(z.compute(), a * 3)


def test_a_graph_of_legacy_tuples_is_left_as_it_is():
    """An array optimization set before dask_overlap's may hand back legacy tuples: they
    are not task objects, so nothing is put into anything."""
    from dask._task_spec import DataNode

    from dask_overlap.graph.rewrite import inlined_data, keyed_task

    g = {
        "a": DataNode("a", np.ones(2)),
        "b": keyed_task("b", np.negative, "a", refs=(0,)),
        "c": (np.negative, "a"),
    }
    assert inlined_data(g, ["b", "c"], lambda t: True) is g


def test_persisted_blocks_go_into_their_partitions_without_a_batch():
    a = grid(120, 8)
    (x,) = dask.persist(da.from_array(a, chunks=(10, 8)))
    y = dask_overlap.map_blocks(lambda b: b + 1, x, split_axis=0, batch=1, dtype=a.dtype)
    assert [k[0] for k in optimized(y)] == [y.name] * 12
    np.testing.assert_array_equal(y.compute(), a + 1)


def test_the_last_batch_is_short_and_blocks_may_differ_in_size(batch_bytes):
    a = grid(100, 8)
    x = da.from_array(a, chunks=((30, 10, 5, 25, 10, 20), (8,)))
    batch_bytes(4 * 30 * 8 * 8)  # four of the largest block
    y = dask_overlap.map_blocks(np.negative, x, split_axis=0)
    assert y.chunks == x.chunks
    np.testing.assert_array_equal(y.compute(), -a)
    assert wait_until_idle()["partitions"] == 2


def test_large_blocks_and_one_block_along_the_axis_are_not_joined(batch_bytes):
    a = grid(120, 8)
    batch_bytes(640)  # the size of one block: nothing to join it with
    f = Calls(np.sqrt)
    y = dask_overlap.map_blocks(f, da.from_array(a, chunks=(10, 8)), split_axis=0, dtype=a.dtype)
    np.testing.assert_array_equal(y.compute(), np.sqrt(a))
    assert f.shapes == [(10, 8)] * 12
    batch_bytes(1 << 30)
    g = Calls(np.sqrt)
    z = dask_overlap.map_blocks(g, da.from_array(a, chunks=(120, 2)), split_axis=0, dtype=a.dtype)
    np.testing.assert_array_equal(z.compute(), np.sqrt(a))
    assert g.shapes == [(120, 2)] * 4  # the split axis has one block: nothing to join


def _with_block_id(b: Any, block_id: Any = None) -> Any:
    return b + 1


def _with_block_info(b: Any, block_info: Any = None) -> Any:
    return b + 1


@pytest.mark.parametrize(
    "func, kwargs",
    [
        (_with_block_id, {"split_axis": 0}),  # its block would not be the output block
        (_with_block_info, {"split_axis": 0}),
        (np.positive, {}),  # no split_axis: func did not say it is independent along one
        (np.positive, {"split_axis": 0, "chunks": (10, 8)}),
        (np.positive, {"split_axis": 0, "batch": 1}),
    ],
)
def test_blocks_are_not_joined_where_it_would_not_be_sound(func, kwargs, batch_bytes):
    a = grid(120, 8)
    batch_bytes(1 << 30)
    y = dask_overlap.map_blocks(func, da.from_array(a, chunks=(10, 8)), dtype=a.dtype, **kwargs)
    expected = a + 1 if func in (_with_block_id, _with_block_info) else a
    np.testing.assert_array_equal(y.compute(), expected)
    assert wait_until_idle()["partitions"] == 12


@pytest.mark.parametrize("blocks, partitions", [(40, 8), (20, 10), (15, 15), (200, 8)])
def test_a_small_array_keeps_eight_partitions_at_least(blocks, partitions):
    a = grid(blocks * 2, 4)
    f = Calls(np.negative)
    y = dask_overlap.map_blocks(f, da.from_array(a, chunks=(2, 4)), split_axis=0, dtype=a.dtype)
    assert y.chunks == ((2,) * blocks, (4,))
    np.testing.assert_array_equal(y.compute(), -a)
    assert wait_until_idle()["partitions"] == len(f.shapes) == partitions


def test_blocks_beside_each_other_count_towards_the_eight_partitions():
    a = grid(64, 16)
    f = Calls(np.negative)
    # 32 blocks down, 4 across: batches of 16 leave 2 x 4 = 8 partitions.
    y = dask_overlap.map_blocks(f, da.from_array(a, chunks=(2, 4)), split_axis=0, dtype=a.dtype)
    assert y.chunks == ((2,) * 32, (4,) * 4)
    np.testing.assert_array_equal(y.compute(), -a)
    assert wait_until_idle()["partitions"] == len(f.shapes) == 8
    assert set(f.shapes) == {(32, 4)}


def test_blocks_of_unknown_extent_are_not_joined(batch_bytes):
    batch_bytes(1 << 30)
    a = grid(120, 8)
    x = da.from_array(a, chunks=(10, 8))
    x = x[x[:, 0] >= 0]  # extents Dask learns only when it computes
    y = dask_overlap.map_blocks(np.negative, x, split_axis=0, dtype=a.dtype)
    np.testing.assert_array_equal(y.compute(), -a)
    assert wait_until_idle()["partitions"] == 12


def test_a_name_given_names_the_array_returned(batch_bytes):
    batch_bytes(1 << 30)
    a = grid()
    y = dask_overlap.map_blocks(
        np.negative, da.from_array(a, chunks=(10, 8)), split_axis=0, name="neg"
    )
    assert y.name == "neg" and y.chunks == ((10,) * 12, (8,))
    # The partition task is named for its batch beside it.
    assert ("neg-batch12", 0, 0) in dict(y.__dask_graph__())
    np.testing.assert_array_equal(y.compute(), -a)
    assert wait_until_idle()["partitions"] == 1


def test_an_error_in_a_batch_names_the_batch(batch_bytes):
    batch_bytes(4 * 640)
    a = grid(160, 8)

    def broken(b: Any) -> Any:
        return b.tolist()  # not an array

    y = dask_overlap.map_blocks(
        broken, da.from_array(a, chunks=(10, 8)), split_axis=0, dtype=a.dtype
    )
    with pytest.raises(TypeError, match=r"partition \('broken-batch4-[0-9a-f]+', [0-3], 0\)"):
        y.compute(scheduler="sync")
    assert wait_until_idle()["partitions_failed"] == 1


@pytest.mark.parametrize("out", ["host", "pinned", "device"])
def test_every_out_mode_with_several_arrays_and_a_broadcast_one(out, batch_bytes):
    a, b = grid(120, 6), grid(120, 6)[::-1].copy()
    row = np.arange(6.0)
    x, y = da.from_array(a, chunks=(10, 3)), da.from_array(b, chunks=(10, 3))
    r = da.from_array(row, chunks=3)
    batch_bytes(6 * 2 * 240)  # six blocks of both arrays

    def combine(p: Any, q: Any, s: Any, scale: float) -> Any:
        return p * scale + q - s

    got = dask_overlap.map_blocks(combine, x, y, r, 0.5, split_axis=0, out=out)
    assert got.chunks == x.chunks
    (done,) = dask.persist(got)
    np.testing.assert_array_equal(done.compute(), a * 0.5 + b - row)
    stats = wait_until_idle()
    assert stats["partitions"] == 2 * 2  # two batches of six, times two column blocks
    assert stats["partitions_failed"] == 0
    del done, got  # the cut blocks held their batches' pool blocks: back now
    assert pinned_in_use_once_collected() == 0


@pytest.mark.parametrize("axis", [0, 1])
def test_new_axis_before_the_split_axis_moves_where_the_output_is_cut(axis, batch_bytes):
    a = grid(60, 40)
    x = da.from_array(a, chunks=(10, 40) if axis == 0 else (60, 5))
    batch_bytes(3 * x.blocks[0, 0].nbytes)

    def f(b: Any) -> Any:
        return b[None, :, :] * 2

    y = dask_overlap.map_blocks(f, x, split_axis=axis, new_axis=0, dtype=a.dtype)
    assert y.chunks == ((1,), *x.chunks)
    np.testing.assert_array_equal(y.compute(), a[None] * 2)
    assert wait_until_idle()["partitions"] == (2 if axis == 0 else 3)


def test_a_second_stage_joins_the_first_stages_blocks_without_a_copy(batch_bytes):
    """The blocks of a batch="auto" stage are consecutive slices of their partition's
    result: a next stage joined the same way gets that result back as it is."""
    from dask_overlap import get_runtime
    from dask_overlap.pipeline.pieces import Pieces, join

    owner = grid(40, 6)
    joined, copied = join(
        get_runtime("host"), Pieces(0, tuple(owner[i : i + 10] for i in range(10, 40, 10))), "p"
    )
    assert copied == 0 and np.shares_memory(joined, owner)
    np.testing.assert_array_equal(joined, owner[10:40])
    # Not each where the one before ends, or not of one dtype: joined by a copy.
    ints = (owner[0:10], owner[10:20].view(np.int64))
    for blocks in [(owner[0:10], owner[20:30]), (owner[10:20], owner[0:10]), ints]:
        joined, _ = join(get_runtime("host"), Pieces(0, blocks), "p")
        assert not np.shares_memory(joined, owner)
        np.testing.assert_array_equal(joined, np.concatenate(blocks))

    batch_bytes(4 * 640)
    a = grid(160, 8)
    first = dask_overlap.map_blocks(np.negative, da.from_array(a, chunks=(10, 8)), split_axis=0)
    f = Calls(lambda b: b * 2)
    second = dask_overlap.map_blocks(f, first, split_axis=0, dtype=a.dtype)
    assert second.chunks == first.chunks == ((10,) * 16, (8,))
    np.testing.assert_array_equal(second.compute(), -a * 2)
    assert sorted(f.shapes) == [(40, 8)] * 4


@pytest.mark.parametrize("out", ["host", "pinned", "device"])
def test_a_second_stage_takes_the_first_stages_partitions_as_they_are(out, batch_bytes):
    """A next auto stage that joins the same blocks gets the first stage's partition
    outputs themselves: neither the slices that cut them nor a join of them runs."""
    batch_bytes(4 * 640)
    a = grid(160, 8)
    first = dask_overlap.map_blocks(
        np.negative, da.from_array(a, chunks=(10, 8)), split_axis=0, out=out
    )
    f = Calls(lambda b: b * 2)
    second = dask_overlap.map_blocks(f, first, split_axis=0, dtype=a.dtype)
    ran = task_prefixes(second)
    assert ran["overlap-unbatch"] == 16, ran  # the second stage's own cut, not the first's
    assert ran["overlap-batch"] == 4, ran  # the first stage's join of from_array's blocks
    assert second.chunks == first.chunks == ((10,) * 16, (8,))
    both = dask.compute(first, second)
    np.testing.assert_array_equal(both[0], -a)  # the first stage's cut blocks still work
    np.testing.assert_array_equal(both[1], -a * 2)
    assert sorted(f.shapes) == [(40, 8)] * 4


def test_a_second_stage_that_joins_other_blocks_joins_the_cut_ones(batch_bytes):
    """Where the next stage joins a different number of blocks (here: it has a second,
    wider input), it joins the first stage's cut blocks as any others."""
    batch_bytes(4 * 640)
    a = grid(160, 8)
    first = dask_overlap.map_blocks(np.negative, da.from_array(a, chunks=(10, 8)), split_axis=0)
    wide = da.from_array(grid(160, 8), chunks=(10, 8))
    shapes: list[tuple[int, ...]] = []

    def f(b: np.ndarray, c: np.ndarray) -> np.ndarray:
        if b.size:
            shapes.append(b.shape)
        return b + c

    second = dask_overlap.map_blocks(f, first, wide, split_axis=0, dtype=a.dtype)
    assert task_prefixes(second)["overlap-unbatch"] == 32  # both stages' cuts run
    np.testing.assert_array_equal(second.compute(scheduler="sync"), -a + grid(160, 8))
    assert sorted(shapes) == [(20, 8)] * 8


def test_a_bad_batch_names_auto_as_the_other_choice():
    x = da.from_array(grid(), chunks=(10, 8))
    with pytest.raises(TypeError, match="batch must be a positive integer or 'auto', got 'Auto'"):
        dask_overlap.map_blocks(np.negative, x, split_axis=0, batch="Auto")


@pytest.mark.timeout(120)
def test_joined_and_cut_back_across_worker_processes(batch_bytes):
    batch_bytes(4 * 640)
    a = grid(200, 8)
    y = dask_overlap.map_blocks(lambda b: b - 1, da.from_array(a, chunks=(10, 8)), split_axis=0)
    assert y.chunks == ((10,) * 20, (8,))
    got, per_worker = compute_on_two_worker_processes(y)
    np.testing.assert_array_equal(got, a - 1)
    assert sum(s["partitions"] for s in per_worker.values()) == 5


@pytest.mark.timeout(120)
@pytest.mark.parametrize("ours", [True, False], ids=["stages-fused", "stages-apart"])
@pytest.mark.parametrize("fuse", [True, False])
def test_a_second_stage_takes_the_first_ones_partitions_across_worker_processes(
    fuse, ours, batch_bytes
):
    """The chain as a cluster runs it, with Dask's low-level fusion on and off (off, the
    graph reaches distributed as layers, the cut one among them), and with dask_overlap's
    own fusion of the two stages on (one partition a batch) and off (two)."""
    batch_bytes(4 * 640)
    a = grid(200, 8)
    first = dask_overlap.map_blocks(np.negative, da.from_array(a, chunks=(10, 8)), split_axis=0)
    second = dask_overlap.map_blocks(lambda b: b * 2, first, split_axis=0, dtype=a.dtype)
    with dask.config.set({"optimization.fuse.active": fuse, "overlap.fuse": ours}):
        got, per_worker = compute_on_two_worker_processes(second)
    np.testing.assert_array_equal(got, -a * 2)
    stages = 1 if ours else 2
    assert sum(s["partitions"] for s in per_worker.values()) == 5 * stages  # 5 batches
