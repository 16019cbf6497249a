"""Dask's own ``map_blocks`` tests, run with ``map_blocks`` routed to ``dask_overlap.map_blocks``.

Every test function of the installed Dask's array tests whose name contains ``map_blocks``
(found in the test modules' source, so a test Dask adds is run too) runs here with
``dask.array.map_blocks``, ``dask.array.core.map_blocks``, ``dask.array.overlap.map_blocks``
(``map_overlap`` with ``depth=0`` calls it) and ``Array.map_blocks`` routed to
``dask_overlap.map_blocks``. Each must make at least one call through the route, so a
test that bypasses it fails rather than passing on Dask's code.

Each runs on the host backend, the timed one (a device modelled on the CPU) and, marked
``gpu``, the cuda one.

Expected failures are the deliberate differences, in :data:`DIFFERENCES` (and, on the GPU
only, :data:`ON_DEVICE`); each ``xfail(strict=True)`` with the reason and the exception it
must raise, so one that starts to pass fails here until its entry is removed.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import inspect
import re
from collections.abc import Callable, Iterator
from pathlib import Path

import dask
import dask.array as da
import dask.array.core
import dask.array.overlap
import numpy as np
import pytest

import dask_overlap
from dask_overlap.graph.rewrite import is_partition_template

# The array test modules of Dask 2026.8 that hold map_blocks tests (test_sparse needs the
# ``sparse`` package; where it is missing its test is reported as skipped, saying so).
DASK_MODULES = ("test_array_core", "test_map_blocks", "test_overlap", "test_sparse")

# Deliberate differences: (module, test) -> (exception, reason).
DIFFERENCES: dict[tuple[str, str], tuple[type[Exception], str]] = {
    ("test_array_core", "test_map_blocks_block_info_with_new_axis"): (
        TypeError,
        "string dtypes are rejected on purpose: a device array cannot hold them "
        "(the input is np.array(['a', 'a', 'b', 'c']))",
    ),
    # Only where pandas and pyarrow are installed (dask.dataframe; otherwise skipped).
    ("test_array_core", "test_map_blocks_series"): (
        TypeError,
        "pandas blocks are refused on purpose, before any work: func returns a Series on "
        "Dask's empty meta blocks, and dask_overlap maps to dense arrays only",
    ),
    # Only where the ``sparse`` package is installed (otherwise skipped on import).
    ("test_sparse", "test_map_blocks"): (
        TypeError,
        "sparse blocks are refused on purpose, before any work: a block is copied to the "
        "device and back as dense data (meta=sparse.COO names what it would lose)",
    ),
}

# On the GPU only (not run yet on a GPU: predicted from the tests' code): ``func`` gets CuPy
# blocks there, as documented, and these two mix them with NumPy arrays.
ON_DEVICE: dict[tuple[str, str], tuple[type[Exception], str]] = {
    ("test_array_core", "test_map_blocks_delayed"): (
        TypeError,
        "func gets CuPy blocks on the GPU, and add(block, y) with y a NumPy array (a "
        "constant, or a delayed one) is CuPy + NumPy, which CuPy refuses",
    ),
    ("test_array_core", "test_map_blocks_chunks"): (
        TypeError,
        "func gets CuPy blocks on the GPU, and np.array([a.max(), b.max()]) converts CuPy "
        "arrays to NumPy implicitly, which CuPy refuses",
    ),
}

# The modules whose ``map_blocks`` name is Dask's function; Array.map_blocks is patched too.
ROUTED_MODULES = (da, dask.array.core, dask.array.overlap)


@contextlib.contextmanager
def routed() -> Iterator[list[str]]:
    """Dask's ``map_blocks`` names all lead to ``dask_overlap.map_blocks`` inside; yields
    the names of the functions mapped through the route, one per call."""
    calls: list[str] = []

    def map_blocks(func: Callable, *args, **kwargs) -> da.Array:
        calls.append(getattr(func, "__name__", type(func).__name__))
        return dask_overlap.map_blocks(func, *args, **kwargs)

    def method(self: da.Array, func: Callable, *args, **kwargs) -> da.Array:
        return map_blocks(func, self, *args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        for module in ROUTED_MODULES:
            mp.setattr(module, "map_blocks", map_blocks)
        mp.setattr(da.Array, "map_blocks", method)
        yield calls


def _dask_test_names(module: str) -> list[str]:
    """The ``map_blocks`` test functions defined in Dask's module, read from its source."""
    spec = importlib.util.find_spec(f"dask.array.tests.{module}")
    source = Path(spec.origin).read_text()
    return re.findall(r"^def (test\w*map_blocks\w*)\(", source, flags=re.M)


def _routed_test(module: str, test: Callable) -> Callable:
    """``test`` run inside :func:`routed`, failing if it made no call through the route;
    Dask's parametrization and marks are kept (``functools.wraps`` copies them)."""

    @functools.wraps(test)
    def run(*args, **kwargs):
        with routed() as calls:
            test(*args, **kwargs)
        assert calls, f"{module}.{test.__name__} never called map_blocks through the route"

    run.dask_test = (module, test.__name__)  # for ON_DEVICE, which the backend fixture reads
    which = (module, test.__name__)
    difference = DIFFERENCES.get(which)
    if difference is not None:
        raises, reason = difference
        run = pytest.mark.xfail(strict=True, raises=raises, reason=reason)(run)
    return run


def _our_name(module: str, name: str) -> str:
    """``test_array_core.test_map_blocks2`` runs here as ``test_array_core__map_blocks2``."""
    return f"test_{module.removeprefix('test_')}__{name.removeprefix('test_')}"


def _skipped(module: str, why: str) -> Callable:
    def skipped() -> None:
        pytest.skip(f"{module} skipped on import: {why}")

    return skipped


def _collect() -> dict[str, Callable]:
    """One routed test per Dask test, named as :func:`_our_name` says; a module that cannot
    be imported here gives one skipped test per test it holds, with the reason."""
    tests: dict[str, Callable] = {}
    for module in DASK_MODULES:
        names = _dask_test_names(module)
        try:
            # (test_overlap marks itself with a mark of Dask's own pytest config, which
            # pyproject.toml registers too; module marks do not reach the routed tests.)
            mod = importlib.import_module(f"dask.array.tests.{module}")
        except pytest.skip.Exception as e:
            for name in names:
                tests[_our_name(module, name)] = _skipped(f"dask.array.tests.{module}", e.msg)
            continue
        for name in names:
            tests[_our_name(module, name)] = _routed_test(module, getattr(mod, name))
    return tests


ROUTED_TESTS = _collect()
globals().update(ROUTED_TESTS)


@pytest.fixture(autouse=True, params=["host", "timed", pytest.param("cuda", marks=pytest.mark.gpu)])
def backend(request: pytest.FixtureRequest) -> Iterator[str]:
    """Every test here on the host backend, the timed one and (``gpu``) the cuda one."""
    on_device = ON_DEVICE.get(getattr(request.function, "dask_test", None))
    if request.param == "cuda" and on_device is not None:
        raises, reason = on_device
        request.applymarker(pytest.mark.xfail(strict=True, raises=raises, reason=reason))
    with dask.config.set({"overlap.backend": request.param}):
        yield request.param


def test_every_dask_map_blocks_test_is_routed():
    """All of Dask's, as many as its source holds; the deliberate differences are among them."""
    expected = {_our_name(m, n) for m in DASK_MODULES for n in _dask_test_names(m)}
    assert set(ROUTED_TESTS) == expected
    assert len(expected) >= 33  # Dask 2026.8: 30 in test_array_core, one in each other
    for module, name in [*DIFFERENCES, *ON_DEVICE]:
        assert _our_name(module, name) in expected


def test_the_route_reaches_dask_overlap_and_is_undone(backend):
    x = da.arange(12, chunks=4)
    with routed() as calls:
        via_function = da.map_blocks(np.negative, x)
        via_core = dask.array.core.map_blocks(np.negative, x)
        via_method = x.map_blocks(np.negative)
        via_overlap = x.map_overlap(np.negative, depth=0, boundary="none")
    assert calls == ["negative"] * 4
    for y in (via_function, via_core, via_method, via_overlap):
        assert _is_partition_layer(y)
        np.testing.assert_array_equal(y.compute(), -np.arange(12))
    stats = dask_overlap.runtime_stats()
    assert stats["backend"] == backend and stats["partitions"] == 4 * x.npartitions
    assert da.map_blocks is dask.array.core.map_blocks is dask.array.overlap.map_blocks
    assert inspect.getmodule(da.map_blocks) is dask.array.core
    assert not _is_partition_layer(x.map_blocks(np.negative))


def _is_partition_layer(y: da.Array) -> bool:
    return is_partition_template(getattr(y.dask.layers[y.name], "task", None))
