"""``dask_overlap.map_overlap`` on a real GPU with cupyx.scipy.ndimage filters (``pytest -m
gpu``; skipped where no GPU is visible): the same results as ``da.map_overlap`` with the
same CuPy function, every boundary made on the device."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import dask
import dask.array as da
import numpy as np
import pytest
from support import GPU_CONFIG, require_gpu, wait_until_idle

import dask_overlap

cp = require_gpu()
ndi = pytest.importorskip("cupyx.scipy.ndimage")

pytestmark = pytest.mark.gpu

BOUNDARIES = ["reflect", "periodic", "nearest", "none", 0.0, 2.5]


@pytest.fixture(autouse=True)
def cuda_config() -> Iterator[None]:
    with dask.config.set(GPU_CONFIG):
        yield


def gaussian(b: Any) -> Any:
    return ndi.gaussian_filter(b, 2.0)  # truncate 4: a radius of 8


def gradient_magnitude(b: Any) -> Any:
    return ndi.gaussian_gradient_magnitude(b, 1.0)


def naive(func: Any) -> Any:
    """The usual Dask + CuPy round trip of a block."""
    return lambda b: cp.asnumpy(func(cp.asarray(b)))


def volume(shape=(96, 40, 36), chunks=(32, 20, 36), seed=0) -> tuple[np.ndarray, da.Array]:
    a = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
    return a, da.from_array(a, chunks=chunks)


def host(x: Any) -> np.ndarray:
    return cp.asnumpy(x) if isinstance(x, cp.ndarray) else np.asarray(x)


@pytest.mark.parametrize("boundary", BOUNDARIES)
@pytest.mark.parametrize("split_axis", [None, 0])
def test_gaussian_as_dask_for_every_boundary(boundary, split_axis) -> None:
    _, x = volume()
    ours = dask_overlap.map_overlap(
        gaussian, x, depth=8, boundary=boundary, split_axis=split_axis, sub_chunk_bytes="64KiB"
    )
    theirs = da.map_overlap(naive(gaussian), x, depth=8, boundary=boundary)
    np.testing.assert_allclose(ours.compute(), theirs.compute(), rtol=1e-5, atol=1e-5)
    stats = wait_until_idle()
    assert stats["partitions"] == x.npartitions
    if split_axis is not None:
        assert stats["sub_chunks"] > x.npartitions


@pytest.mark.parametrize("out", ["host", "pinned", "device"])
@pytest.mark.parametrize("direct", [False, True], ids=["ring", "direct"])
def test_gradient_magnitude_out_modes_and_paths(out, direct) -> None:
    _, x = volume(chunks=(24, 20, 18))
    config = {"overlap.direct-bytes": "1GiB"} if direct else {}
    with dask.config.set(config):
        ours = dask_overlap.map_overlap(
            gradient_magnitude, x, depth={0: 4, 1: 4, 2: 4}, boundary="nearest", out=out
        ).compute()
    theirs = da.map_overlap(naive(gradient_magnitude), x, depth=4, boundary="nearest").compute()
    np.testing.assert_allclose(host(ours), theirs, rtol=1e-5, atol=1e-5)


def test_device_input_and_per_axis_boundaries() -> None:
    a, x = volume()
    on_gpu = x.map_blocks(cp.asarray, meta=cp.empty((0, 0, 0), np.float32))
    boundary = {0: "periodic", 1: "reflect", 2: 0.0}
    ours = dask_overlap.map_overlap(gaussian, on_gpu, depth=8, boundary=boundary, split_axis=0)
    theirs = da.map_overlap(naive(gaussian), x, depth=8, boundary=boundary)
    np.testing.assert_allclose(host(ours.compute()), theirs.compute(), rtol=1e-5, atol=1e-5)


def test_a_filter_then_a_threshold_then_a_sum() -> None:
    """Composes with fusion: the trim comes before the steps that follow."""
    _, x = volume()
    ours = (dask_overlap.map_overlap(gaussian, x, depth=8, boundary="reflect") > 0.05).sum()
    theirs = (da.map_overlap(naive(gaussian), x, depth=8, boundary="reflect") > 0.05).sum()
    assert int(host(ours.compute())) == int(theirs.compute())


def test_only_the_core_comes_back() -> None:
    _, x = volume()
    dask_overlap.map_overlap(gaussian, x, depth=8, boundary="reflect").compute()
    stats = wait_until_idle()
    assert stats["bytes_d2h"] == x.nbytes
    padded = da.overlap.overlap(x, 8, boundary="reflect")
    assert x.nbytes < stats["bytes_h2d"] <= padded.nbytes


def test_pinned_input_goes_piece_by_piece_into_one_device_buffer() -> None:
    """An earlier stage's pinned blocks are not staged: core and slabs are each copied to
    their place in the padded block on the device."""
    _, x = volume()
    pinned = dask_overlap.map_blocks(lambda b: b + 0, x, out="pinned", dtype=np.float32)
    ours = dask_overlap.map_overlap(gaussian, pinned, depth=8, boundary="reflect", split_axis=0)
    theirs = da.map_overlap(naive(gaussian), x, depth=8, boundary="reflect")
    np.testing.assert_allclose(ours.compute(), theirs.compute(), rtol=1e-5, atol=1e-5)
