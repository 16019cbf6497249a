"""The public API as users see it: ``dir(dask_overlap)`` and ``__all__``."""

from __future__ import annotations

import dask_overlap


def test_dir_shows_the_public_api_and_nothing_else() -> None:
    names = dir(dask_overlap)
    assert set(dask_overlap.__all__) <= set(names)
    # The lazily loaded names too, which a module's default dir() leaves out.
    assert {"LocalGPUCluster", "register", "OverlapPlugin"} <= set(names)
    for private in ("Any", "TYPE_CHECKING", "annotations"):
        assert private not in names
    assert names == sorted(names)
    # Every name dir() shows resolves.
    for name in names:
        getattr(dask_overlap, name)


def test_all_is_sorted() -> None:
    assert dask_overlap.__all__ == sorted(dask_overlap.__all__)
