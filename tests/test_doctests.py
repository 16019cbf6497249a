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

_ALL = sorted(m.name for m in pkgutil.walk_packages(dask_overlap.__path__, "dask_overlap."))
MODULES = [name for name in _ALL if not any(part in name for part in _GPU_MODULES)]
GPU_MODULES = [name for name in _ALL if name not in MODULES]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name: str) -> None:
    _examples_run(name)


@pytest.mark.gpu
@pytest.mark.parametrize("name", GPU_MODULES)
def test_gpu_docstring_examples(name: str) -> None:
    _examples_run(name)


def _examples_run(name: str) -> None:
    module = importlib.import_module(name)
    dask_overlap.close_runtimes()  # each module's examples from a fresh runtime
    flags = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
    result = doctest.testmod(module, optionflags=flags, verbose=False, report=True)
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples failed"
