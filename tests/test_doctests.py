"""The examples in the package's docstrings run as written (CPU modules; the cuda ones run
where CuPy is, on the GPU machine)."""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest

import dask_overlap

#: Modules whose examples need CuPy (or a GPU).
_GPU_MODULES = ("cuda", "kernel_pickling", "nvtx")

MODULES = sorted(
    m.name
    for m in pkgutil.walk_packages(dask_overlap.__path__, "dask_overlap.")
    if not any(part in m.name for part in _GPU_MODULES)
)


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name: str) -> None:
    module = importlib.import_module(name)
    dask_overlap.close_runtimes()  # each module's examples from a fresh runtime
    flags = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
    result = doctest.testmod(module, optionflags=flags, verbose=False, report=True)
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples failed"
