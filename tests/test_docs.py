"""The documentation builds, with Sphinx and warnings as errors, as CI builds it; what is
generated (the API, the configuration, the ``runtime_stats()`` keys, the performance page)
is all there; and the public API as users see it (``dir(dask_overlap)``, ``__all__``)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

import dask_overlap
from dask_overlap.cluster.local import THREADS_PER_WORKER

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"


def sphinx_build(out: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``sphinx-build -W -b html docs OUT`` in a fresh process; fails the test if it fails."""
    done = subprocess.run(
        [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html", *args,
         str(DOCS), str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=240, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    return done


def text_of(page: Path) -> str:
    """A built page's text, tags dropped and whitespace collapsed."""
    return " ".join(re.sub(r"<[^>]+>", " ", page.read_text()).split())


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("html")
    sphinx_build(out)
    return out


@pytest.mark.timeout(300)
def test_the_api_page_documents_every_public_name(site: Path) -> None:
    api = (site / "api.html").read_text()
    for name in dask_overlap.__all__:
        # autodoc's anchor for each object, with its docstring beside it.
        assert f'id="dask_overlap.{name}"' in api, name
    text = text_of(site / "api.html")
    for key in dask_overlap.get_runtime("host").stats():
        assert key in text, key  # every runtime_stats() key is described


def test_the_configuration_table_is_generated_from_the_yaml(site: Path) -> None:
    text = text_of(site / "configuration.html")
    defaults = yaml.safe_load((ROOT / "dask_overlap" / "overlap.yaml").read_text())["overlap"]
    for key, value in defaults.items():
        assert f"overlap.{key}" in text, key
        if not isinstance(value, dict):
            assert f"overlap.{key} {value} " in text, key  # the default beside its key


def test_the_performance_page_shows_every_results_file(site: Path) -> None:
    text = text_of(site / "performance.html")
    for path in sorted((ROOT / "benchmarks" / "results").glob("*.json")):
        assert f"benchmarks/results/{path.name}" in text, path.name


@pytest.mark.timeout(300)
def test_the_performance_page_reads_whatever_results_exist(tmp_path: Path) -> None:
    """Names are not relied on: a file written by --record shows its card, date and
    figures under any name, with its runs in history.jsonl counted; a plain output shows
    its headline numbers."""
    results = tmp_path / "results"
    results.mkdir()
    record = {
        "benchmark": "default-path", "date": "2031-01-02", "device": "Some GPU 9000",
        "commit": "abc1234", "figures": {"size_bytes": 1 << 30, "naive_gbps": 1.5,
                                         "split_gbps": 12.25, "correct": True},
        "result": {"anything": 1},
    }  # fmt: skip
    (results / "renamed-by-someone.json").write_text(json.dumps(record))
    plain = {"device": "Other GPU", "gbps": {"dask_overlap": 3.5, "plain": 1.75}, "ratio": 2.0}
    (results / "zarr-pipeline-new.json").write_text(json.dumps(plain))
    history = [{"benchmark": "default-path", "date": f"2030-0{i}-01"} for i in (1, 2, 3)]
    (results / "history.jsonl").write_text("".join(json.dumps(h) + "\n" for h in history))
    out = tmp_path / "html"
    sphinx_build(out, "-D", f"overlap_results={results}")
    text = text_of(out / "performance.html")
    assert (
        "renamed-by-someone.json : Some GPU 9000, 2031-01-02, commit abc1234 "
        "(3 run(s) of default-path in history.jsonl)" in text
    ), text
    assert "naive GB/s: 1.50; split GB/s: 12.25; correct: yes" in text, text
    assert "zarr-pipeline-new.json : Other GPU, not recorded" in text, text
    assert "dask_overlap GB/s: 3.50; plain GB/s: 1.75; ratio: 2" in text, text


def test_the_docs_give_the_threads_default_the_code_has() -> None:
    clusters = (DOCS / "guide" / "clusters.md").read_text()
    assert f"The default is **{THREADS_PER_WORKER}**" in " ".join(clusters.split())


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
