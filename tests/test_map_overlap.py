"""``dask_overlap.map_overlap`` gives what ``dask.array.map_overlap`` gives (host backend),
without a padded block built in Dask tasks."""

from __future__ import annotations

import dask
import dask.array as da
import numpy as np
import pytest
from support import compute_on_two_worker_processes

import dask_overlap
from dask_overlap.graph.halo import halo_array
from dask_overlap.pipeline.halo import HaloBlock

BOUNDARIES = ["reflect", "periodic", "nearest", "none", 0, -2.5]
#: Options of dask_overlap's alone, left out of the call to Dask's map_overlap.
OURS = ("split_axis", "sub_chunk_bytes", "in_flight", "out", "batch")


def stencil(b: np.ndarray) -> np.ndarray:
    """A local stencil: radius 1 on every axis and 2 along axis 0 (depth 2 there), the
    block's own edges clamped (as a filter's ``nearest`` mode)."""
    p = np.pad(b, 2, mode="edge")

    def shifted(ax: int, by: int) -> np.ndarray:
        index = [slice(2, 2 + n) for n in b.shape]
        index[ax] = slice(2 + by, 2 + by + b.shape[ax])
        return p[tuple(index)]

    out = 3 * b
    for ax in range(b.ndim):
        out = out + shifted(ax, -1) - 0.5 * shifted(ax, 1)
    return out + 0.25 * shifted(0, -2) - 0.125 * shifted(0, 2)


@pytest.fixture(autouse=True)
def poisoned(monkeypatch) -> None:
    """Every padded buffer starts as NaN (on the host backend, and in the ring), so that
    a side left unmade shows in the results rather than as whatever memory held."""
    from dask_overlap.backends.host import HostBackend
    from dask_overlap.pipeline.inputs import HaloInput

    def empty_device(self, shape, dtype):
        out = np.empty(shape, dtype)
        if out.dtype.kind == "f":
            out[...] = np.nan
        return out

    staged = HaloInput.staged

    def poisoned_staged(self, block):
        out = staged(self, block)
        view = out.pieces[0][1].array
        if view.dtype.kind == "f":
            view[...] = np.nan
        return out

    monkeypatch.setattr(HostBackend, "empty_device", empty_device)
    monkeypatch.setattr(HaloInput, "staged", poisoned_staged)


@pytest.fixture
def x3() -> da.Array:
    rng = np.random.default_rng(0)
    return da.from_array(rng.standard_normal((13, 11, 6)), chunks=((4, 4, 5), (3, 4, 4), (6,)))


def overlap_equal(func, *args, **kwargs) -> np.ndarray:
    """Ours and Dask's, compared element by element; ours returned."""
    ours = dask_overlap.map_overlap(func, *args, **kwargs)
    theirs = da.map_overlap(func, *args, **{k: v for k, v in kwargs.items() if k not in OURS})
    assert ours.shape == theirs.shape and ours.chunks == theirs.chunks
    got = ours.compute()
    np.testing.assert_array_equal(got, theirs.compute())
    return got


# -- results equal to Dask's ---------------------------------------------------------
@pytest.mark.parametrize("boundary", BOUNDARIES)
@pytest.mark.parametrize("depth", [1, {0: 2, 1: 1}, {0: 0, 1: 2, 2: 1}])
def test_every_boundary_and_depth(x3, boundary, depth) -> None:
    overlap_equal(stencil, x3, depth=depth, boundary=boundary)


@pytest.mark.parametrize(
    "boundary",
    [
        {0: "periodic", 1: "reflect", 2: "nearest"},
        {0: "nearest", 1: 0.5, 2: "periodic"},
        {0: 7.0, 1: -1.0},  # constants on two axes: the corners are the later axis's
        ("reflect", "none", "periodic"),
    ],
)
def test_boundaries_per_axis(x3, boundary) -> None:
    overlap_equal(stencil, x3, depth={0: 2, 1: 1, 2: 1}, boundary=boundary)


def test_asymmetric_depths(x3) -> None:
    overlap_equal(stencil, x3, depth={0: (2, 1), 1: (0, 2), 2: (1, 0)}, boundary="none")


@pytest.mark.parametrize("ring", [False, True], ids=["direct", "ring"])
@pytest.mark.parametrize("split_axis", [0, 1])
@pytest.mark.parametrize("boundary", ["reflect", "periodic", "nearest", "none", 3.0])
def test_split_axis_cuts_partitions_with_halos(x3, ring, split_axis, boundary) -> None:
    # Sub-chunks as small as they may be: as many rows as the depth along the split axis
    # (2), so that each window is its rows and a halo of 2 on either side.
    with dask.config.set({"overlap.direct-bytes": 0} if ring else {}):
        overlap_equal(
            stencil,
            x3,
            depth={0: 2, 1: 2, 2: 1},
            boundary=boundary,
            split_axis=split_axis,
            sub_chunk_bytes=1,
        )
        stats = dask_overlap.runtime_stats()
    assert stats["partitions"] == 9
    # Every partition cut (a halo along the split axis does not force whole ones).
    assert stats["sub_chunks"] == sum(-(-n // 2) for n in x3.chunks[split_axis]) * 3
    assert (stats["bytes_staged"] > 0) == ring


def test_on_the_timed_backend(x3) -> None:
    """The device modelled on the CPU: cut partitions on its streams, the same results."""
    with dask.config.set({"overlap.backend": "timed"}):
        overlap_equal(stencil, x3, depth={0: 2, 1: 1}, boundary="reflect", split_axis=0,
                      sub_chunk_bytes=1)  # fmt: skip
        stats = dask_overlap.runtime_stats("timed")
    assert stats["sub_chunks"] > stats["partitions"] == 9


def test_several_arrays_with_their_own_depths() -> None:
    rng = np.random.default_rng(1)
    a = da.from_array(rng.standard_normal((12, 10)), chunks=(4, 5))
    b = da.from_array(rng.standard_normal((12, 10)), chunks=(6, 5))  # aligned as Dask does
    c = da.from_array(rng.standard_normal(10), chunks=5)  # broadcast along axis 0

    def f(p, q, r):
        return stencil(p) + 2 * q - r

    depth = [{0: 2, 1: 1}, {0: 2, 1: 1}, 1]
    overlap_equal(f, a, b, c, depth=depth, boundary=["reflect", 0, "periodic"])

    def sizes(p, q):  # each array padded by its own depth
        return np.full(p.shape, p.size + 1000 * q.size, dtype=np.int64)

    overlap_equal(sizes, a, b, depth=[{0: 1, 1: 1}, {0: 2, 1: 0}], boundary="none", dtype=int)


def test_trim_false_func_trims_itself(x3) -> None:
    def f(b):
        return stencil(b)[2:-2, 1:-1, 1:-1]

    overlap_equal(f, x3, depth={0: 2, 1: 1, 2: 1}, boundary="reflect", trim=False)


def test_block_info_and_block_id_as_dasks(x3) -> None:
    seen: dict[str, dict] = {"ours": {}, "theirs": {}}

    def record(which):
        def f(b, block_info=None, block_id=None):
            if isinstance(block_id, tuple):
                seen[which][block_id] = block_info
            return b

        return f

    for boundary in ["none", "reflect", {0: "periodic", 1: "none"}]:
        kwargs = {"depth": {0: 2, 1: 1}, "boundary": boundary, "dtype": x3.dtype}
        dask_overlap.map_overlap(record("ours"), x3, **kwargs).compute()
        da.map_overlap(record("theirs"), x3, **kwargs).compute(scheduler="sync")
        assert len(seen["ours"]) == 9
        assert seen["ours"] == seen["theirs"]


def test_block_info_of_sub_chunks_is_their_window(x3) -> None:
    """With sub-chunks, block_info says where each padded sub-block lies."""
    base = x3.compute()
    padded = np.pad(base, ((2, 2), (1, 1), (0, 0)), mode="symmetric")
    checked = []

    def f(b, block_info=None):
        if block_info is not None:
            (r0, r1), (c0, c1), _ = block_info[0]["array-location"]
            checked.append(b.shape[0])
            # The overlapped array's rows for this window: Dask's, with padding made here.
            if block_info[0]["chunk-location"] == (0, 0, 0):
                np.testing.assert_array_equal(b, padded[r0:r1, c0:c1])
        return b

    dask_overlap.map_overlap(
        f,
        x3,
        depth={0: 2, 1: 1},
        boundary="reflect",
        split_axis=0,
        sub_chunk_bytes=1,
        dtype=x3.dtype,
    ).compute()
    assert len(checked) > 9


@pytest.mark.parametrize("out", ["host", "pinned", "device"])
def test_out_modes(x3, out) -> None:
    overlap_equal(stencil, x3, depth=1, boundary="reflect", out=out, split_axis=0)


def test_batch_is_one_block_a_partition(x3) -> None:
    overlap_equal(stencil, x3, depth=1, boundary="periodic", split_axis=0, batch="auto")
    assert dask_overlap.runtime_stats()["partitions"] == 9
    with pytest.raises(ValueError, match="batch must be 'auto' or 1 with map_overlap"):
        dask_overlap.map_overlap(stencil, x3, depth=1, split_axis=0, batch=2)


def test_depth_larger_than_a_chunk_rechunks_as_dask() -> None:
    x = da.from_array(np.arange(40.0).reshape(20, 2), chunks=((2, 8, 1, 9), 2))
    got = overlap_equal(lambda b: b + np.roll(b, 3, 0), x, depth={0: 3}, boundary="reflect")
    assert got.shape == (20, 2)


def test_drop_axis(x3) -> None:
    overlap_equal(
        lambda b: b.sum(axis=2), x3, depth={0: 1, 1: 1, 2: 0}, boundary="reflect", drop_axis=2
    )
    # Several blocks along the dropped axis (no halo there): joined as Dask joins them.
    x = x3.rechunk({2: 3})
    overlap_equal(lambda b: b.sum(axis=2), x, depth={0: 1, 1: 1, 2: 0}, drop_axis=2)


def test_new_axes_are_placed_as_map_blocks_places_them() -> None:
    """A new axis after the existing ones (new_axis=2 on 2-D data, or inferred from
    chunks=) was taken modulo the input's rank and trimmed on the wrong axes. (Dask's own
    map_overlap is wrong here too: the expected values are worked out by hand.)"""
    a = np.random.default_rng(0).standard_normal((9, 7))
    x = da.from_array(a, chunks=((4, 5), (3, 4)))
    trailing = dask_overlap.map_overlap(
        lambda b: (2 * b)[..., None], x, depth=1, boundary="reflect", new_axis=2, dtype=float
    )
    np.testing.assert_array_equal(trailing.compute(), (2 * a)[..., None])
    both = dask_overlap.map_overlap(
        lambda b: (2 * b)[None, :, None], x, depth=1, boundary="reflect", new_axis=[2, 0]
    )
    np.testing.assert_array_equal(both.compute(), (2 * a)[None, :, None])

    def gradients(b):
        return np.stack(np.gradient(b), axis=-1)

    padded = ((6, 7), (5, 6), (2,))  # chunks= of the padded blocks, the new axis last
    got = dask_overlap.map_overlap(
        gradients, x, depth=1, boundary="reflect", new_axis=2, chunks=padded, dtype=float
    )
    assert got.chunks == ((4, 5), (3, 4), (2,))
    whole = gradients(np.pad(a, 1, mode="symmetric"))[1:-1, 1:-1]
    blocks = [gradients(np.pad(a, 1, mode="symmetric")[r0:r1, c0:c1])[1:-1, 1:-1]
              for r0, r1 in ((0, 6), (4, 11)) for c0, c1 in ((0, 5), (3, 9))]  # fmt: skip
    rows = [np.concatenate(blocks[i : i + 2], axis=1) for i in (0, 2)]
    expected = np.concatenate(rows, axis=0)
    assert expected.shape == whole.shape
    np.testing.assert_allclose(got.compute(), expected)
    lead = ((1,), (6, 7), (5, 6))  # a new first axis, said only by chunks= (as map_blocks)
    got = dask_overlap.map_overlap(lambda b: (2 * b)[None], x, depth=1, boundary="reflect",
                                   chunks=lead, dtype=float)  # fmt: skip
    np.testing.assert_array_equal(got.compute(), (2 * a)[None])


def test_chunks_of_ints_and_tuples_as_dask(x3) -> None:
    x = da.from_array(np.arange(96.0).reshape(12, 8), chunks=(3, 4))
    got = overlap_equal(lambda b: b + 1, x, depth=1, boundary="reflect", chunks=((5,) * 4, 6))
    assert got.shape == (12, 8)


def test_block_info_of_the_output_under_chunks_is_the_padded_one_as_dasks() -> None:
    x = da.from_array(np.arange(63.0).reshape(9, 7), chunks=((4, 5), (5, 2)))
    seen: dict[str, list] = {"ours": [], "theirs": []}

    def record(which):
        def f(b, block_info=None):
            if block_info is not None:
                seen[which].append(block_info[None])
            return b

        return f

    kw = {"depth": 1, "boundary": "reflect", "chunks": ((6, 7), (7, 4)), "dtype": float}
    dask_overlap.map_overlap(record("ours"), x, **kw).compute(scheduler="sync")
    da.map_overlap(record("theirs"), x, **kw).compute(scheduler="sync")
    key = lambda info: info["chunk-location"]  # noqa: E731
    assert sorted(seen["ours"], key=key) == sorted(seen["theirs"], key=key)


@pytest.mark.filterwarnings("ignore:invalid value encountered in cast:RuntimeWarning")
@pytest.mark.filterwarnings("ignore::numpy.exceptions.ComplexWarning")
@pytest.mark.parametrize(
    "dtype, constant", [("int32", np.nan), ("int32", 1e20), ("int32", 1 + 2j), ("f8", 1 + 2j)]
)
def test_a_constant_boundary_is_cast_to_the_arrays_dtype_as_dask_casts_it(dtype, constant):
    x = da.from_array(np.arange(20).reshape(4, 5).astype(dtype), chunks=(2, 3))
    overlap_equal(lambda v: v + np.roll(v, 1, 0), x, depth=1, boundary=constant)


def test_depth_zero_is_map_blocks(x3) -> None:
    overlap_equal(lambda b: b * 2, x3, depth=0, boundary="reflect")


def test_a_fused_threshold_and_sum_follow_the_trim(x3) -> None:
    """A step after map_overlap runs on the trimmed block (as fused or not)."""
    ours = (dask_overlap.map_overlap(stencil, x3, depth=1, boundary="reflect") > 0).sum()
    theirs = (da.map_overlap(stencil, x3, depth=1, boundary="reflect") > 0).sum()
    assert ours.compute() == theirs.compute()


def test_chained_stages_and_halos(x3) -> None:
    """A stage, a halo filter, another with another boundary, a threshold and a sum."""

    def ours(x):
        y = dask_overlap.map_blocks(lambda b: b * 2, x, split_axis=0)
        z = dask_overlap.map_overlap(stencil, y, depth={0: 2, 1: 1, 2: 1}, boundary="reflect",
                                     split_axis=0)  # fmt: skip
        return dask_overlap.map_overlap(stencil, z, depth={0: 2, 1: 1, 2: 1}, boundary="periodic")

    def theirs(x):
        z = da.map_overlap(stencil, x * 2, depth={0: 2, 1: 1, 2: 1}, boundary="reflect")
        return da.map_overlap(stencil, z, depth={0: 2, 1: 1, 2: 1}, boundary="periodic")

    np.testing.assert_array_equal(ours(x3).compute(), theirs(x3).compute())
    assert (ours(x3) > 0).sum().compute() == (theirs(x3) > 0).sum().compute()


def test_stored_as_dask_stores_it(x3) -> None:
    """A store of map_overlap's output (fused into its partitions where fusion does so)
    writes the trimmed blocks."""
    target = np.zeros(x3.shape)
    y = dask_overlap.map_overlap(stencil, x3, depth={0: 2, 1: 1}, boundary="nearest", split_axis=0)
    da.store(y, target, lock=False)
    theirs = da.map_overlap(stencil, x3, depth={0: 2, 1: 1}, boundary="nearest").compute()
    np.testing.assert_array_equal(target, theirs)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_on_two_worker_processes(x3) -> None:
    """Slabs travel between workers as any block's slice does (pickled views)."""
    y = dask_overlap.map_overlap(stencil, x3, depth={0: 2, 1: 1}, boundary="periodic", split_axis=0)
    got, stats = compute_on_two_worker_processes(y)
    theirs = da.map_overlap(stencil, x3, depth={0: 2, 1: 1}, boundary="periodic").compute()
    np.testing.assert_array_equal(got, theirs)
    assert sum(s["partitions"] for s in stats.values()) == 9


# -- no padded block in Dask's tasks -------------------------------------------------
def test_each_partition_gets_its_core_and_views_of_edge_slabs() -> None:
    base = np.arange(12 * 10.0).reshape(12, 10)
    x = da.from_array(base, chunks=(4, 5))
    h = halo_array(x, {0: 2, 1: 1}, {0: "reflect", 1: "none"})
    blocks = dict(
        zip(
            dask.core.flatten(h.__dask_keys__()),
            dask.compute(
                *[h.blocks[i, j] for i in range(3) for j in range(2)],
                scheduler="sync",
                optimize_graph=False,
            ),
            strict=True,
        )
    )
    for block in blocks.values():
        assert type(block) is HaloBlock
        core, *slabs = block.pieces
        # The core is the block itself; every slab a view of a neighbour, no thicker than
        # the depth across an axis it pads.
        assert core.shape == block.shape
        assert all(s.base is not None for s in slabs)
        assert all(s.shape[0] <= 2 or s.shape[1] <= 1 for s in slabs)
    middle = blocks[(h.name, 1, 0)]
    assert middle.spec.margins == ((2, 2), (0, 1))  # none: no halo at the array's edge
    assert middle.spec.shape == (8, 6)
    # Reflected sides are made on the device, never in a task: the first row has no slab above.
    first = blocks[(h.name, 0, 0)]
    assert any(f[:2] == (0, 0) for f in first.spec.fills)
    assert all(r[0].start >= 2 for r in first.spec.regions)


def test_no_concatenation_in_the_graph(x3) -> None:
    y = dask_overlap.map_overlap(stencil, x3, depth=1, boundary="reflect")
    (opt,) = dask.optimize(y)
    names = {k[0].rsplit("-", 1)[0] for k in dict(opt.__dask_graph__()) if isinstance(k, tuple)}
    assert not any(
        "concatenate" in n or n.startswith("overlap-") and "halo" not in n for n in names
    )
    # Dask's own builds its padded blocks by concatenation.
    (theirs,) = dask.optimize(da.map_overlap(stencil, x3, depth=1, boundary="reflect"))
    assert any("concatenate" in str(k) for k in dict(theirs.__dask_graph__()))


def test_the_ring_assembles_the_padded_block_in_one_staging_copy(ring_only) -> None:
    x = da.from_array(np.arange(12 * 10.0).reshape(12, 10), chunks=(4, 5))
    y = overlap_equal(lambda b: b * 2, x, depth={0: 2, 1: 1}, boundary="none")
    assert y.shape == (12, 10)
    stats = dask_overlap.runtime_stats()
    # With boundary none every padded element comes from a block: the staging copies
    # together move exactly the padded blocks, which one copy each takes to the device.
    padded = da.overlap.overlap(x, {0: 2, 1: 1}, boundary="none")
    assert stats["bytes_staged"] == padded.nbytes
    assert stats["bytes_h2d"] == padded.nbytes
    assert stats["bytes_d2h"] == x.nbytes  # trimmed before the copy back


# -- bad input, refused before anything runs ------------------------------------------
def _never(b):
    raise AssertionError("func ran")


@pytest.mark.parametrize(
    ("kwargs", "error", "words"),
    [
        ({"depth": -1}, ValueError, "depth must be a non-negative integer, got -1"),
        ({"depth": 1.5}, TypeError, "depth must be a non-negative integer"),
        ({"depth": {0: "2"}}, TypeError, r"depth\[0\] must be a non-negative integer"),
        ({"depth": (1, 2)}, ValueError, "one entry per axis"),
        ({"depth": {5: 1}}, ValueError, "depth is keyed by axis: got key 5"),
        ({"depth": [1, 1]}, ValueError, "depth given as a list must have one entry per array"),
        ({"depth": 1, "boundary": "wrap"}, ValueError, "boundary must be one of 'reflect'"),
        ({"depth": 1, "boundary": {0: [1]}}, ValueError, r"boundary\[0\] must be one of"),
        ({"depth": 1, "trim": "yes"}, TypeError, "trim must be True or False"),
        ({"depth": 30}, ValueError, "The overlapping depth 30 is larger than your array 13"),
        (
            {"depth": {0: 5}, "allow_rechunk": False},
            ValueError,
            "Overlap depth is larger than smallest chunksize",
        ),
        (
            {"depth": {0: (1, 2)}, "boundary": "reflect"},
            NotImplementedError,
            "Asymmetric overlap is currently only implemented for boundary='none'",
        ),
        ({"depth": 1, "batch": 3}, ValueError, "batch must be 'auto' or 1"),
        ({"depth": 1, "boundary": ("reflect",)}, ValueError, r"boundary given as a tuple must"),
        ({"depth": 1, "allow_rechunk": "no"}, TypeError, "allow_rechunk must be True or False"),
        ({"depth": 1, "align_arrays": "no"}, TypeError, "align_arrays must be True or False"),
        (
            {"depth": 1, "drop_axis": 1},  # at compute time before: refused when built now
            NotImplementedError,
            r"cannot join the padded blocks .* along an axis it drops .* \(axis 1\)",
        ),
    ],
)
def test_bad_input_is_refused_before_anything_runs(x3, kwargs, error, words) -> None:
    with pytest.raises(error, match=words):
        dask_overlap.map_overlap(_never, x3, meta=np.empty((0, 0, 0)), **kwargs)


def test_not_arrays_and_not_callable(x3) -> None:
    with pytest.raises(TypeError, match="must all be dask arrays"):
        dask_overlap.map_overlap(_never, x3, 3, depth=1)
    with pytest.raises(TypeError, match="func must be callable"):
        dask_overlap.map_overlap("f", x3, depth=1)


def test_func_that_changes_the_shape_under_trim_names_trim(x3) -> None:
    y = dask_overlap.map_overlap(lambda b: b[1:], x3, depth=1, boundary="reflect", dtype=float)
    with pytest.raises(ValueError, match="trim=True requires .* to keep the shape of the block"):
        y.compute()


def test_deprecated_signature_warns_as_dask(x3) -> None:
    with pytest.warns(FutureWarning, match="deprecated since dask 2.17.0"):
        y = dask_overlap.map_overlap(x3, stencil, 1, "reflect")
    np.testing.assert_array_equal(
        y.compute(), da.map_overlap(stencil, x3, depth=1, boundary="reflect").compute()
    )


# -- Dask's own map_overlap tests, routed here ----------------------------------------
from dask.array.tests import test_overlap as _dask_tests  # noqa: E402

#: Dask's tests that differ on purpose, and why (docs/guide/map_overlap.md says so too).
DIFFERENCES = {
    "test_map_overlap_multiarray_different_depths": "func returns a 0-d block where its "
    "chunks declare (0,): every block is checked against the chunks it declares",
    "test_map_overlap_new_axis": "func returns blocks of 2 along the new axis where the "
    "chunks declare 1: every block is checked against the chunks it declares",
    "test_map_overlap_deprecated_signature": "with depth 0 func returns a 0-d block where "
    "the chunks declare (3,): every block is checked against the chunks it declares",
    "test_overlap_few_dimensions_small": "asserts on the keys of Dask's overlap layers, "
    "which are not built",
    "test_overlap_few_dimensions": "asserts that a halo on fewer axes makes a smaller "
    "graph; here the graph is one task per block and partition whatever the axes",
}


def _routes_to_map_overlap(fn) -> bool:
    import inspect

    return "map_overlap" in inspect.getsource(fn)


for _name, _fn in list(vars(_dask_tests).items()):
    if _name.startswith("test_") and callable(_fn) and _routes_to_map_overlap(_fn):
        if _name in DIFFERENCES:
            _fn = pytest.mark.xfail(reason=DIFFERENCES[_name], strict=True)(_fn)
        globals()[f"test_dask_{_name[5:]}"] = _fn
del _name, _fn


@pytest.fixture(autouse=True)
def routed(request, monkeypatch):
    """Dask's tests call ``da.map_overlap`` and ``Array.map_overlap``: both route here, and
    each must make at least one call through the route (one that bypassed it would pass
    on Dask's code). (This module's own tests compare with Dask's: not routed.)"""
    if not request.node.name.startswith("test_dask_"):
        yield
        return
    calls = []

    def route(*args, **kwargs):
        calls.append(1)
        return dask_overlap.map_overlap(*args, **kwargs)

    monkeypatch.setattr(da, "map_overlap", route)
    monkeypatch.setattr(da.overlap, "map_overlap", route)
    monkeypatch.setattr(_dask_tests, "map_overlap", route, raising=False)
    yield
    assert calls, f"{request.node.name} made no call to map_overlap through the route"
