"""Partitions read the blocks that ``da.concatenate`` and ``x.blocks[...]`` stand for, with
no alias task between them and the partition (a scheduling round each on a cluster)."""

from __future__ import annotations

from collections import Counter
from typing import Any

import dask
import dask.array as da
import numpy as np
import pytest
from support import task_prefixes

import dask_overlap
import dask_overlap.graph.rewrite
from dask_overlap.graph.rewrite import alias_targets, aliases_seen_through


def add(a: Any, b: Any) -> Any:
    return a + b


def reversed_blocks(x: da.Array) -> da.Array:
    return da.concatenate([x.blocks[i] for i in reversed(range(x.numblocks[0]))])


@pytest.fixture
def x() -> da.Array:
    return da.from_array(np.arange(96, dtype=np.float64).reshape(24, 4), chunks=(3, 4))


@pytest.mark.parametrize("batch", [1, 4, "auto"])
def test_a_reordered_input_is_read_from_its_blocks_with_no_alias_tasks(x, batch):
    r = reversed_blocks(x)
    y = dask_overlap.map_blocks(add, x, r, split_axis=0, batch=batch, dtype=x.dtype)
    counts = task_prefixes(y)
    assert "concatenate" not in counts and "blocks" not in counts, counts
    assert counts["array"] == 8  # from_array's blocks, each read by two partitions
    np.testing.assert_array_equal(y.compute(), x.compute() + r.compute())


def test_each_partition_names_the_blocks_themselves(x):
    r = reversed_blocks(x)
    y = dask_overlap.map_blocks(add, x, r, split_axis=0, batch=1, dtype=x.dtype)
    seen = aliases_seen_through(y.dask, [y.name], [y.name])  # (as optimizing does)
    tasks = dict(seen.layers[y.name])
    assert seen.dependencies[y.name] == {x.name}
    for i in range(8):
        assert tasks[(y.name, i, 0)].dependencies == {(x.name, i, 0), (x.name, 7 - i, 0)}


def test_chains_of_alias_layers_are_followed_to_the_end(x):
    a = da.concatenate([x[:12], x[12:]])  # slices: getitem tasks, not aliases
    b = da.concatenate([reversed_blocks(x).blocks[i] for i in range(8)])  # alias of alias
    subs = alias_targets(b.dask, [b.name])
    assert {k[1]: v for k, v in subs.items()} == {i: (x.name, 7 - i, 0) for i in range(8)}
    assert not alias_targets(x.dask, [x.name])  # from_array's own blocks: no aliases
    y = dask_overlap.map_blocks(add, a, b, split_axis=0, batch=1, dtype=x.dtype)
    counts = task_prefixes(y)
    assert "blocks" not in counts, counts
    np.testing.assert_array_equal(y.compute(), a.compute() + b.compute())


def test_a_layer_that_computes_is_not_seen_through(x):
    flipped = x[::-1]  # getitem tasks that reverse each block: work, not aliases
    y = dask_overlap.map_blocks(add, x, flipped, split_axis=0, batch=1, dtype=x.dtype)
    assert y.dask.layers[y.name] is not None and flipped.name in y.dask.dependencies[y.name]
    np.testing.assert_array_equal(y.compute(), x.compute() + x.compute()[::-1])


def test_an_alias_layer_another_input_needs_is_kept(x):
    r = reversed_blocks(x)
    r10 = r * 10
    y = dask_overlap.map_blocks(add, r, r10, split_axis=0, batch=1, dtype=x.dtype)
    graph = aliases_seen_through(y.dask, [y.name], [y.name])  # (as optimizing does)
    # r * 10 still reads r's aliases; the partitions read x's blocks directly.
    assert graph.dependencies[y.name] == {x.name, r10.name}
    assert r.name in graph.layers and graph.dependencies[r10.name] == {r.name}
    np.testing.assert_array_equal(y.compute(), r.compute() * 11)


def test_annotations_and_the_partition_task_survive_the_rewrite(x):
    r = reversed_blocks(x)
    with dask.annotate(retries=3):
        y = dask_overlap.map_blocks(add, x, r, split_axis=0, batch=1, dtype=x.dtype)
    layer = y.dask.layers[y.name]
    assert layer.annotations == {"retries": 3}
    plain = dask_overlap.map_blocks(add, x, x, split_axis=0, batch=1, dtype=x.dtype)
    kinds = {type(t) for t in dict(layer).values()}
    assert kinds == {type(t) for t in dict(plain.dask.layers[plain.name]).values()}


def test_a_stage_over_a_reordered_input_still_takes_in_the_steps_after_it(x):
    """Seen through when the graph is optimized, after fusion: a partition layer seen
    through at construction was a materialized one, so nothing after it was fused."""
    r = reversed_blocks(x)
    y = dask_overlap.map_blocks(lambda b: b * 2, r, split_axis=0, batch=1) + 1
    assert "fused: 2 steps" in dask_overlap.explain(y)
    counts = task_prefixes(y)
    assert "concatenate" not in counts and "blocks" not in counts, counts
    np.testing.assert_array_equal(y.compute(), r.compute() * 2 + 1)


def test_an_array_with_no_alias_inputs_is_returned_as_it_is(x):
    y = da.map_blocks(add, x, x + 1, dtype=x.dtype)
    assert aliases_seen_through(y.dask, [y.name], [y.name]) is y.dask


def test_on_a_cluster_no_alias_task_runs():
    from distributed import Client, LocalCluster, get_task_stream, wait

    with (
        LocalCluster(
            processes=True, n_workers=2, threads_per_worker=1, dashboard_address=":0"
        ) as cluster,
        Client(cluster) as client,
    ):
        x = client.persist(da.arange(64, chunks=8, dtype=np.float64))
        wait(x)
        r = reversed_blocks(x)
        y = dask_overlap.map_blocks(add, x, r, split_axis=0, batch=1, dtype=x.dtype)
        with get_task_stream(client) as stream:
            got = y.compute()
        blocks = [rec["key"] for rec in stream.data if isinstance(rec["key"], tuple)]
        ran = Counter(key[0].rsplit("-", 1)[0] for key in blocks)
        np.testing.assert_array_equal(got, np.arange(64) + r.compute())
    assert ran == {"add": 8}, ran
