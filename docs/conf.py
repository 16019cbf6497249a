"""Sphinx configuration of dask_overlap's documentation.

Build it with ``sphinx-build -W -b html docs docs/_build/html`` (the ``docs`` extra has
what it needs). The API reference is autodoc over the package; the configuration table,
the ``runtime_stats()`` keys and the performance page are generated at build time by
``_ext/overlap_docs.py`` from ``overlap.schema.json`` + ``overlap.yaml``, the runtime and
``benchmarks/results/``.
"""

from __future__ import annotations

import os
import sys

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir))
sys.path.insert(0, ROOT)  # this checkout's package, not an installed copy
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "_ext"))

import dask_overlap  # noqa: E402

project = "dask_overlap"
author = "the dask_overlap developers"
copyright = "the dask_overlap developers"
release = dask_overlap.__version__
version = release

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "myst_parser",
    "overlap_docs",
]
source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
exclude_patterns = ["_build"]
myst_heading_anchors = 3

autodoc_member_order = "bysource"
autodoc_typehints = "signature"  # the types in the signature; the docstrings say the rest
napoleon_google_docstring = False
napoleon_numpy_docstring = True
napoleon_use_param = False  # "a, b : text" stays one entry, not the text once per name

html_theme = "alabaster"
html_theme_options = {
    "description": "Dask GPU work as an assembly line",
    "fixed_sidebar": True,
}
html_static_path: list[str] = []
