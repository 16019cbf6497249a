"""``benchmarks/bench_cross.py`` (#16) runs on the CPU path: two real worker processes over
TCP, every stage-2 pair crossing them, results equal to plain Dask's and the JSON the GPU
run is read by. No figure is asserted on (a shared machine times nothing reliably)."""

from __future__ import annotations

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "benchmarks"))
import bench_cross  # noqa: E402

ROW_KEYS = {
    "local_gbps",
    "crossing_gbps",
    "crossing_over_local",
    "local_reordered_gbps",
    "crossing_over_local_reordered",
    "pairs_crossed",
    "pairs",
    "correct",
    "skipped",
}


@pytest.mark.timeout(120)
def test_bench_cross_on_the_cpu(tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # the CPU path, even beside a GPU
    path = tmp_path / "x.json"
    summary = bench_cross.main(
        ["--allow-cpu", "--protocols", "tcp", "--size", "8MiB", "--partitions", "4",
         "--repeat", "1", "--json", str(path)]
    )  # fmt: skip
    written = json.loads(path.read_text())
    assert written == json.loads(json.dumps(summary))
    assert written["device"] == "cpu"
    assert set(written["targets"]) == {bench_cross.TARGET_UCX, bench_cross.TARGET_TCP}
    # No row ran on a GPU ("device" chunks are NumPy arrays here): nothing to judge.
    assert all(met is None for met in written["targets"].values())
    assert set(written["results"]) == {"tcp"}
    for chunks in ("host", "device"):
        row = written["results"]["tcp"][chunks]
        assert ROW_KEYS <= set(row), chunks
        assert row["skipped"] is None and "error" not in row, row
        assert row["correct"] is True, chunks
        # Blocks 0-1 on one worker, 2-3 on the other: every reversed pair crosses, the
        # local variant moves nothing, and at least half of y moves when crossing.
        assert row["pairs"] == 4 and row["pairs_crossed"] == 4, row
        assert row["y_blocks_per_worker"] == [2, 2], row
        assert row["local_bytes_moved"] == row["local_reordered_bytes_moved"] == 0, row
        assert written["size_bytes"] // 2 <= row["bytes_moved"] <= written["size_bytes"], row
        assert row["local_gbps"] > 0 and row["crossing_gbps"] > 0
        # Every crossing fetch is in the transfer logs' summary.
        fetches = row["crossing_transfers"]
        assert 1 <= fetches["fetches"] <= 4 and fetches["first_fetch_after_seconds"] >= 0, row
        assert 0 < fetches["fetching_fraction_of_stage"] <= 1, row


def test_a_missing_ucx_is_skipped_with_its_reason(tmp_path, monkeypatch):
    def missing(what: str) -> None:
        raise ImportError(f"{what} needs distributed-ucxx")

    monkeypatch.setattr(bench_cross, "require_ucx", missing)
    summary = bench_cross.main(["--protocols", "ucxx", "--json", str(tmp_path / "x.json")])
    for chunks in ("host", "device"):
        row = summary["results"]["ucxx"][chunks]
        assert row["skipped"] == "protocol='ucxx' needs distributed-ucxx"
    assert not bench_cross.failed(summary)
    assert all(met is None for met in summary["targets"].values())


def test_an_unknown_protocol_is_refused_before_anything_starts():
    with pytest.raises(SystemExit):
        bench_cross.main(["--protocols", "carrier-pigeon"])


def test_the_targets_are_judged_on_gpu_rows_only():
    def row(crossing: float, local: float, backend: str = "cuda") -> dict:
        return {"crossing_gbps": crossing, "crossing_over_local": crossing / local,
                "backend": backend}  # fmt: skip

    results = {
        "tcp": {"host": row(3.0, 10.0), "device": row(4.0, 20.0)},
        "ucxx": {"device": row(12.0, 20.0)},
    }
    assert bench_cross.targets(results) == {
        bench_cross.TARGET_UCX: True,
        bench_cross.TARGET_TCP: True,
    }
    results["ucxx"]["device"] = row(12.0, 30.0)  # 0.4 of local
    results["tcp"]["device"] = row(2.0, 20.0)
    assert set(bench_cross.targets(results).values()) == {False}
    results["ucxx"]["device"] = row(12.0, 20.0, backend="host")
    assert bench_cross.targets(results)[bench_cross.TARGET_UCX] is None
