"""The benchmark harness: ``benchmarks/common.py``'s results files, the rule that no script
imports another, and every CPU-runnable benchmark run on the CPU path, each in a process of
its own (they set ``dask.config`` for the whole process), through its ``--record``. Counts,
structure and correctness are asserted on, never a figure (a shared machine times nothing
reliably)."""

from __future__ import annotations

import ast
import importlib.util
import json
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))
import common  # noqa: E402

SCRIPTS = sorted([*BENCHMARKS.glob("*.py"), *BENCHMARKS.glob("diagnostics/*.py")])


def history(folder: Path) -> list[dict]:
    lines = (folder / "history.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def test_record_writes_the_current_file_and_appends_one_history_line(tmp_path):
    result = {"gbps": 2.5, "runs": [1, 2]}
    line = common.record("demo", {"gbps": 2.5}, "cpu", tmp_path / "demo.json", result)
    (written,) = history(tmp_path)
    assert written == line
    assert tuple(written) == common.HISTORY_KEYS
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", written["date"])
    assert written["commit"] == common.git_commit()  # this checkout's, or None without git
    assert (written["device"], written["benchmark"], written["figures"]) == (
        "cpu",
        "demo",
        {"gbps": 2.5},
    )
    assert json.loads((tmp_path / "demo.json").read_text()) == {**line, "result": result}
    # A second run replaces the current file and adds a line; the first line stays.
    common.record("demo", {"gbps": 3.0}, "cpu", tmp_path / "demo.json", {"gbps": 3.0})
    assert [h["figures"]["gbps"] for h in history(tmp_path)] == [2.5, 3.0]
    assert json.loads((tmp_path / "demo.json").read_text())["result"] == {"gbps": 3.0}


def test_a_case_replaces_only_itself_in_the_current_file(tmp_path):
    path = tmp_path / "overlap.json"
    common.record("overlap", {"a": {"x": 1}}, "gpu", path, {"a": 1}, merge=True)
    common.record("overlap", {"b": {"x": 2}}, "gpu", path, {"b": 2}, merge=True)
    common.record("overlap", {"a": {"x": 3}}, "gpu", path, {"a": 3}, merge=True)
    current = json.loads(path.read_text())
    assert current["result"] == {"a": 3, "b": 2}
    assert current["figures"] == {"a": {"x": 3}, "b": {"x": 2}}
    # Another device's run is not merged with this one's cases.
    common.record("overlap", {"c": {"x": 4}}, "cpu", path, {"c": 4}, merge=True)
    assert json.loads(path.read_text())["result"] == {"c": 4}
    assert len(history(tmp_path)) == 4


def test_gpu_test_counts_sum_the_summaries_or_count_the_marks_of_a_cut_log():
    log = (
        "# a note: 19 passed in 8.23s\n"
        "....F..s [100%]\n"
        "==== 1 failed, 6 passed, 1 skipped, 40 deselected in 3.10s ====\n"
        "12 passed, 2 errors in 1.00s\n"
    )
    assert common.gpu_test_counts(log) == {
        "passed": 18,
        "failed": 1,
        "skipped": 1,
        "errors": 2,
        "complete": True,
    }
    cut = "....................s [ 48%]\n..F.\n"
    assert common.gpu_test_counts(cut) == {
        "passed": 23,
        "failed": 1,
        "skipped": 1,
        "errors": 0,
        "complete": False,
    }


def test_the_results_folder_is_current_files_and_a_history():
    lines = history(common.RESULTS)
    for line in lines:  # backfilled lines also say where they came from
        assert set(common.HISTORY_KEYS) <= set(line) <= {*common.HISTORY_KEYS, "source", "note"}
        assert re.match(r"\d{4}-\d\d-\d\d", line["date"]) and isinstance(line["figures"], dict)
    benchmarks = {line["benchmark"] for line in lines}
    assert {"default-path", "overlap", "cross-worker", "gpu-tests"} <= benchmarks
    current = set()
    for path in (p for p in common.RESULTS.iterdir() if p.suffix != ".log"):  # logs: untracked
        assert not re.search(r"\d{4}-\d\d-\d\d", path.name), f"a dated name: {path.name}"
        data = json.loads(path.read_text()) if path.suffix == ".json" else None
        if isinstance(data, dict) and "benchmark" in data:  # written by common.record
            assert set(data) == {*common.HISTORY_KEYS, "result"}, path.name
            assert data["benchmark"] == path.stem
            current.add(path.stem)
    assert current == benchmarks  # each benchmark of the history has its current file


def test_no_benchmark_script_imports_another():
    names = {p.stem for p in SCRIPTS} - {"common"}
    assert {"bench_default", "bench_overlap", "chained_stages"} <= names  # found them
    for path in SCRIPTS:
        imported = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                imported |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                imported.add(node.module.split(".")[0])
        assert not imported & names, f"{path.relative_to(BENCHMARKS)} imports {imported & names}"


def run(script: str, *argv: str, record: Path) -> dict:
    """``script`` run with ``--record record``: the result it wrote."""
    return common.run_script(BENCHMARKS / script, [*argv, "--record", str(record)])


def refused(script: str, *argv: str) -> subprocess.CompletedProcess:
    """``script`` run on the host backend with ``argv``, its output kept: for arguments it
    must refuse before any work."""
    return subprocess.run(
        [sys.executable, str(BENCHMARKS / script), "--backend", "host", *argv],
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.timeout(120)
def test_bench_default_on_the_cpu(tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    argv = ["--size", "16MiB", "--partition", "4MiB", "--no-gaussian", "--repeat", "1"]
    result = run("bench_default.py", *argv, record=tmp_path)
    assert result["correct"] is True and result["device"] == "cpu"
    assert result["size_bytes"] == 16 << 20 and result["handwritten"] == []  # CUDA only
    (line,) = history(tmp_path)
    assert line["benchmark"] == "default-path" and line["figures"]["correct"] is True
    current = json.loads((tmp_path / "default-path.json").read_text())
    assert current["result"] == result


@pytest.mark.timeout(120)
def test_bench_overlap_records_its_cases_on_the_cpu(tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    argv = ["--backend", "host", "--size", "8MiB", "--partition", "2MiB", "--threads", "2"]
    pageable = run("bench_overlap.py", *argv, record=tmp_path)
    pinned = run("bench_overlap.py", *argv, "--pinned-input", "--case", "p", record=tmp_path)
    assert pageable["correct"] is True and pinned["correct"] is True
    assert (pageable["partitions"], pinned["input"]) == (4, "pinned")
    current = json.loads((tmp_path / "overlap-host.json").read_text())
    assert set(current["result"]) == {"balanced-pageable", "p"}
    assert [h["benchmark"] for h in history(tmp_path)] == ["overlap-host"] * 2


@pytest.mark.timeout(120)
def test_bench_halo_on_the_cpu(tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    argv = ["--backend", "host", "--size", "4MiB", "--block", "512KiB", "--plane", "64"]
    result = run("bench_halo.py", *argv, "--repeat", "1", record=tmp_path)
    assert result["correct"] is True and result["device"] == "cpu"
    assert result["boundaries_checked"] == ["reflect", "periodic", "nearest", "none", "0.0"]
    assert result["size_bytes"] == 4 << 20 and result["block_bytes"] == 512 << 10
    keys = {"naive_gbps", "overlap_then_map_blocks_gbps", "map_overlap_gbps", "no_halo_gbps",
            "map_overlap_over_no_halo", "speedup_vs_naive", "edges_made_gbps",
            "edge_reuse_ceiling"}  # fmt: skip
    assert keys <= set(result) and all(result[k] > 0 for k in keys)
    assert result["edge_bytes_share"] == pytest.approx(16 / 48)  # 2 x 8 planes on 32
    (line,) = history(tmp_path)
    assert line["benchmark"] == "halo" and line["figures"]["correct"] is True


@pytest.mark.timeout(120)
def test_host_overhead_on_the_cpu(tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    result = run("host_overhead.py", "--partitions", "40", "--repeat", "1", record=tmp_path)
    assert result["partitions"] == 40 and result["partition_bytes"] == 64 << 10
    (line,) = history(tmp_path)
    assert line["benchmark"] == "host-overhead" and line["device"] == "cpu"
    assert set(line["figures"]) == set(result) - {"backend"}


def test_peak_memory_on_the_cpu_within_the_stated_multiple(tmp_path, monkeypatch):
    """A batch="auto" partition's host peak stays within the stated multiple of its
    bytes (traced allocations: a bound, not a timing), and a partition a block near
    plain Dask's."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    result = run("peak_memory.py", "--backend", "host", "--size", "64MiB", record=tmp_path)
    assert result["auto_batch"] == 2  # 16 blocks: at least 8 partitions
    assert result["overlap_auto_host_peak_ratio"] <= result["stated_multiple"] + 0.25
    assert result["overlap_batch_1_host_peak_ratio"] <= result["dask_host_peak_ratio"] + 0.25
    (line,) = history(tmp_path)
    assert line["benchmark"] == "peak-memory"


@pytest.mark.timeout(180)
def test_bench_cluster_and_its_scaling_on_the_cpu(tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    argv = ["--allow-cpu", "--workers", "1", "--threads", "1", "--size", "8MiB"]
    argv += ["--partition", "2MiB", "--repeat", "1", "--iterations", "2"]
    (row,) = run("bench_cluster.py", *argv, record=tmp_path)
    assert row["correct"] is True and row["iterations"] == 2 and row["partitions"] == 4
    (line,) = history(tmp_path)
    assert line["benchmark"] == "cluster-1-workers"
    assert line["figures"]["threads=1"]["correct"] is True
    # bench_scaling.py runs bench_cluster.py once per worker count and mode.
    scaling = common.run_script(
        BENCHMARKS / "diagnostics" / "bench_scaling.py",
        ["--workers", "1", "--threads", "1", "--size", "4MiB", "--partition", "2MiB"]
        + ["--backend", "host", "--allow-cpu"],
    )
    assert [len(scaling[m]) for m in ("weak", "strong")] == [1, 1]
    assert all(r["correct"] and r["efficiency"] == 1.0 for m in scaling.values() for r in m)


@pytest.mark.timeout(120)
def test_result_reuse_runs_each_variant_and_bounds_the_pool_on_the_cpu(tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    argv = ["--size", "16MiB", "--partition", "4MiB", "--repeat", "2", "--long", "3"]
    argv += ["--persist-pool", "16MiB", "--stream-pool", "8MiB"]
    result = run("diagnostics/result_reuse.py", *argv, record=tmp_path)
    assert result["correct"] is True and result["device"] == "cpu"
    assert set(result["persisted_gbps"]) == {"split_none", "split_pool", "whole_none", "whole_pool"}
    assert [len(v["pairs"]) for v in result["persisted_pool_over_none"].values()] == [2, 2]
    assert len(result["stored_pool_over_none"]["pairs"]) == 2
    assert len(result["long_rss_bytes"]) == 3
    assert result["long_idle_max_bytes"] <= 8 << 20
    (line,) = history(tmp_path)
    assert line["benchmark"] == "result-reuse" and line["figures"]["correct"] is True


@pytest.mark.timeout(180)
def test_small_partitions_runs_bench_overlap_per_case_on_the_cpu(tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    argv = ["--backend", "host", "--sizes", "64KiB", "--threads", "2", "--repeat", "1"]
    script = "diagnostics/small_partitions.py"
    result = run(script, *argv, "--direct-off", "--batch", "4", record=tmp_path)
    row = result["sizes"]["64KiB"]  # 256 blocks of 64 KiB, by default and with batch=4
    assert (row["partitions"], row["batch"], row["batch_4"]["batch"]) == (256, "auto", 4)
    assert row["correct"] and row["batch_4"]["correct"] and row["through_the_ring"]["correct"]
    (line,) = history(tmp_path)
    assert set(line["figures"]["out_host"]) == {"64KiB", "64KiB through_the_ring", "64KiB batch_4"}


def test_ceilings_on_the_cpu(tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    result = common.run_script(
        BENCHMARKS / "diagnostics" / "ceilings.py", ["--backend", "host", "--partition", "4MiB"]
    )
    assert result["device"] == "cpu" and result["partition_bytes"] == 4 << 20
    assert {"h2d", "d2h", "staging", "fresh"} <= set(result["rates_gbps"])


def test_thread_cpu_says_whose_cpu_time_it_was():
    """Threads of one name with numbers (a pool's) are summed under it, their CPU time
    counted from /proc as long as they are alive."""
    before = common.thread_cpu()
    done, release = threading.Barrier(3), threading.Event()

    def spin() -> None:
        t0 = time.thread_time()
        while time.thread_time() - t0 < 0.2:
            pass
        done.wait()
        release.wait(30)  # alive until counted

    threads = [threading.Thread(target=spin, name=f"spinner-{i}_{i}") for i in range(2)]
    for t in threads:
        t.start()
    done.wait()
    spent = common.thread_cpu_since(before)
    release.set()
    for t in threads:
        t.join()
    assert spent["spinner"] >= 0.35  # two threads of 0.2 s each, counted in clock ticks
    assert not any(name.startswith("spinner-") for name in spent)
    assert list(spent.values()) == sorted(spent.values(), reverse=True)


@pytest.mark.timeout(300)
def test_bench_limits_runs_every_row_on_the_cpu(tmp_path, monkeypatch):
    """Every case of issue 31's table in one call (the demo's cluster too), each row set
    against its bound or reference, every result checked."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    argv = ["--backend", "host", "--size", "8MiB", "--partition", "2MiB", "--repeat", "1"]
    argv += ["--small", "512KiB=2MiB", "--pinned-repeat", "2", "--small-threads", "2"]
    argv += ["--pinned-size", "4MiB"]
    result = run("bench_limits.py", *argv, record=tmp_path)
    rows = result["rows"]
    assert result["device"] == "cpu" and result["cases"] == list(result["case_seconds"])
    assert set(rows) == {
        "default_split",
        "default_nosplit",
        "gaussian1d",
        "gaussian3d",
        "demo",
        "small_512kiB_host",
        "small_512kiB_pinned",
        "pinned",
        "compute",
    }
    for name, row in rows.items():
        base = row.get("bound_gbps", row.get("reference_gbps"))
        assert ("bound_gbps" in row) != ("reference_gbps" in row), name
        assert row["correct"] is True and row["gbps"] > 0 and base > 0, name
        assert row["ratio"] == pytest.approx(row["gbps"] / base), name
    # The pinned case reports each run and is its slowest; the others their best.
    pinned = rows["pinned"]
    assert len(pinned["runs"]) == len(pinned["ratio_each_run"]) == 2
    assert pinned["size_bytes"] == 4 << 20  # --pinned-size, not --size
    assert rows["compute"]["size_bytes"] == 8 << 20
    assert pinned["gbps"] == min(r["gbps"] for r in pinned["runs"])
    for r in pinned["runs"]:  # what each run counted, and whose CPU time it used
        assert r["counted"]["partitions"] == pinned["partitions"], r["counted"]
        assert all(v > 0 for v in r["thread_cpu_seconds"].values())
        assert set(r["engine_busy"]) >= {"h2d", "compute", "d2h"}
    # The compute case's kernel is the slowest of the device's stages. (On the host
    # backend every stage also shares the same cores, and whether their sum, "host_cpu",
    # or the kernel alone is the bound depends on the rates this machine measured.)
    stages = rows["compute"]["stages_gbps"]
    engines = {k: v for k, v in stages.items() if k != "host_cpu"}
    assert min(engines, key=engines.get) == "kernel", stages
    assert rows["compute"]["bound_stage"] in ("kernel", "host_cpu")
    assert rows["small_512kiB_host"]["partitions"] == 4
    assert rows["gaussian3d"]["volume_shape"] == [8, 512, 512]
    for variant in ("filter", "elementwise"):  # over its timed runs alone
        got = rows["gaussian3d"]["counted"][variant]
        assert got["partitions"] == 4 and got["pinned_refused"] == 0, got  # 4 blocks, 1 run
        assert all(v > 0 for v in got["thread_cpu_seconds"].values())
    assert rows["demo"]["worker_backends"] == ["host"] and rows["demo"]["reference_correct"]
    assert len(rows["demo"]["ratio_pairs"]) == 1  # one round: the reference run in turn
    demo = rows["demo"]  # each side's seconds, and its scheduler's cost with no work
    assert demo["reference_seconds"] == pytest.approx(demo["seconds"] * demo["ratio"])
    assert demo["cluster_noop_seconds"] > 0 and demo["threaded_noop_seconds"] > 0
    (p,) = demo["cluster_phases"]  # one cluster run: every task's compute found, split
    assert p["computes"] == 4 and p["span_ms"] > 0 and 0 < p["busy"] <= 1  # 8 MiB in 2 MiB
    assert p["hop_max_ms"] >= p["hop_mean_ms"] >= 0
    assert rows["demo"]["over_default_split"] == pytest.approx(
        rows["demo"]["gbps"] / rows["default_split"]["gbps"]
    )
    (line,) = history(tmp_path)
    assert line["benchmark"] == "limits" and set(line["figures"]) == set(rows)
    assert json.loads((tmp_path / "limits.json").read_text())["result"] == result


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--cases", "default,nope"], "--cases: expected a comma list of default"),
        (["--small", "16MiB"], "expected PARTITION=SIZE pairs such as 16MiB=2GiB, got '16MiB'"),
        (["--pinned-repeat", "0"], "expected an integer of at least 1, got '0'"),
        (["--small-threads", "4,x"], "--small-threads: expected an integer of at least 1"),
        (["--hand-threads", ""], "--hand-threads: expected a comma list of integers of at"),
        (["--size", "0B"], "--size: expected a byte count of at least 1, got 0"),
    ],
)
def test_bench_limits_refuses_bad_arguments_before_any_work(argv, words):
    out = refused("bench_limits.py", *argv)
    assert out.returncode == 2 and words in out.stderr
    assert "==" not in out.stdout  # no case started


def test_the_harness_examples_run_as_written():
    import doctest

    result = doctest.testmod(common, optionflags=doctest.ELLIPSIS, report=True)
    assert result.attempted >= 2 and result.failed == 0  # same_chunks, pair_ratios, phases, ...


def test_runs_in_turn_make_pairs(monkeypatch):
    """``persist_in_turn`` runs each array once per round, in order and then in the reverse
    order by turns, and checks every run."""
    order: list[str] = []
    times = iter([1.0, 2.0, 1.0, 1.5, 3.0, 2.0])

    def run(arr, **kw):
        order.append(arr)
        return next(times), [arr]

    monkeypatch.setattr(common, "persist_chunks", run)
    seconds, ok = common.persist_in_turn({"a": "A", "b": "B"}, 3, lambda got: got != ["B"])
    assert order == ["A", "B", "B", "A", "A", "B"]
    assert seconds == {"a": [1.0, 1.5, 3.0], "b": [2.0, 1.0, 2.0]}
    assert ok == {"a": True, "b": False}
    ratios = common.pair_ratios(seconds["a"], seconds["b"])
    assert ratios["pairs"] == [2.0, 1.0 / 1.5, 2.0 / 3.0] and ratios["median"] == 2.0 / 3.0
    assert ratios["best"] == 1.0


@pytest.mark.timeout(120)
def test_split_gap_counts_each_run_on_its_own_on_the_cpu(tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    argv = ["--size", "16MiB", "--partition", "4MiB", "--repeat", "2"]
    result = run("diagnostics/split_gap.py", *argv, record=tmp_path)
    assert result["correct"] is True and result["device"] == "cpu"
    assert [r["case"] for r in result["runs"]] == ["split", "whole"] * 2
    # Each run's counts are its own: its four partitions, not the runs' before it.
    assert all(r["partitions"] == 4 and r["sub_chunks"] >= 4 for r in result["runs"])
    assert len(result["split_over_nosplit_pairs"]) == 2
    (line,) = history(tmp_path)
    assert line["benchmark"] == "split-gap" and line["figures"]["correct"] is True


@pytest.mark.timeout(180)
def test_pool_reuse_runs_each_round_in_a_process_of_its_own_on_the_cpu(tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    argv = ["--backend", "host", "--size", "8MiB", "--partition", "2MiB", "--rounds", "2"]
    result = run("diagnostics/pool_reuse.py", *argv, "--repeat", "1", record=tmp_path)
    # On the host backend there is no device pool: only the library's mode runs.
    assert result["device"] == "cpu" and result["modes"] == ["library"]
    rows = result["compared"]["library"]
    assert set(rows) == {"filter", "elementwise", "elementwise_split"}
    assert all(r["correct"] and r["over_library_each_round"] == [1.0, 1.0] for r in rows.values())
    # Each round's counts are its own process's timed run: 8 MiB in four 2 MiB blocks.
    for variant in rows:
        counts = [r["library"]["variants"][variant]["counted"] for r in result["rounds"]]
        assert [c["partitions"] for c in counts] == [4, 4]
    (line,) = history(tmp_path)  # the children write no line of their own
    assert line["benchmark"] == "pool-reuse"
    variants = ("filter", "elementwise", "elementwise_split")
    assert set(line["figures"]) == {f"library_{v}" for v in variants}


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--modes", "no-internal-deps"], "--modes: only library runs on the host backend"),
        (["--modes", "library,nope"], "--modes: expected a comma list of library"),
        (["--partition", "64KiB"], "--partition: expected at least one 1 MiB plane"),
        (["--rounds", "0"], "--rounds: expected an integer of at least 1, got 0"),
    ],
)
def test_pool_reuse_refuses_bad_arguments_before_any_work(argv, words):
    out = refused("diagnostics/pool_reuse.py", *argv)
    assert out.returncode == 2 and words in out.stderr
    assert "== round" not in out.stdout  # no process started


def test_pool_reuse_compares_every_mode_with_the_library_round_by_round():
    sys.path.insert(0, str(BENCHMARKS / "diagnostics"))
    import pool_reuse

    def mode(*gbps: float, correct: bool = True) -> dict:
        names = ("filter", "elementwise")
        pairs = zip(names, gbps, strict=True)
        return {"variants": {n: {"gbps": g, "correct": correct} for n, g in pairs}}

    rounds = [
        {"library": mode(10.0, 20.0), "no-internal-deps": mode(12.0, 20.0)},
        {"library": mode(8.0, 20.0), "no-internal-deps": mode(12.0, 10.0, correct=False)},
    ]
    got = pool_reuse.compare(rounds)
    filt = got["no-internal-deps"]["filter"]
    assert filt["gbps_each_round"] == [12.0, 12.0] and filt["best_gbps"] == 12.0
    assert filt["over_library_each_round"] == [1.2, 1.5] and filt["over_library_median"] == 1.35
    assert got["no-internal-deps"]["elementwise"]["over_library_each_round"] == [1.0, 0.5]
    # One wrong round makes the variant wrong; the library's own ratios are 1.
    assert not got["no-internal-deps"]["elementwise"]["correct"] and filt["correct"] is False
    assert got["library"]["filter"]["over_library_each_round"] == [1.0, 1.0]
    # A mode whose process failed is left out of the rounds it failed in, and a mode that
    # failed in every round keeps only its error; the library failing leaves no ratio.
    failed = {"mode": "rmm-pool", "error": "its process exited with 1"}
    rounds[0]["rmm-pool"], rounds[1]["rmm-pool"] = failed, mode(16.0, 20.0)
    rounds[0]["library"] = {"mode": "library", "error": "its process exited with 1"}
    got = pool_reuse.compare(rounds)
    assert got["rmm-pool"]["filter"]["gbps_each_round"] == [16.0]
    assert got["rmm-pool"]["filter"]["over_library_each_round"] == [2.0]
    assert got["library"]["filter"]["gbps_each_round"] == [8.0]
    rounds[1]["rmm-pool"] = failed
    assert pool_reuse.compare(rounds)["rmm-pool"] == {"error": "its process exited with 1"}


def test_copy_streams_refuses_a_machine_without_a_gpu_before_any_work(monkeypatch):
    """The diagnostic measures a GPU's copy engines: on the CPU it says so and stops."""
    if importlib.util.find_spec("cupy") is not None:
        pytest.skip("CuPy is installed here: the script would run")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    out = subprocess.run(
        [sys.executable, str(BENCHMARKS / "diagnostics" / "copy_streams.py"), "--size", "1MiB"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 1
    assert "copy_streams.py measures a GPU's copy engines" in out.stderr
    assert "Traceback" not in out.stderr


@pytest.mark.timeout(120)
def test_copy_streams_runs_the_library_at_each_setting_in_turn(monkeypatch):
    """The diagnostic's library part on this machine's backend: a run at each in_flight
    and switch interval per round, in turn, each checked, and Python's own interval put
    back."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    sys.path.insert(0, str(BENCHMARKS / "diagnostics"))
    import argparse

    import copy_streams
    import numpy as np

    host = np.arange(64 * common.COLS, dtype=np.float32).reshape(64, common.COLS)
    func = common.make_kernel(2)
    expect = func(host[:4])
    args = argparse.Namespace(
        threads=2,
        repeat=2,
        in_flight=[2, 4],
        switch_intervals=[0.004, 0.001],
        timing=["sampled", "all", "off"],
    )
    import dask_overlap
    from dask_overlap.pipeline.sampling import StageSampler

    # The host backend's marks cost nothing, so it has no sampler: give it one, as the
    # cuda backend has, whose estimates stand in for the spans of sub-chunks not timed.
    monkeypatch.setattr(dask_overlap.get_runtime(), "sampler", StageSampler())
    before = sys.getswitchinterval()
    decide = copy_streams_work().timed
    runs = copy_streams.library_runs(args, host, 16, func, expect)
    assert sys.getswitchinterval() == before
    assert copy_streams_work().timed is decide  # the timing patches undone
    assert [
        (r["round"], r["in_flight"], r["switch_interval"], r["device_timing"]) for r in runs
    ] == [
        (i, f, s, t)
        for i in (0, 1)
        for f in (2, 4)
        for s in (0.004, 0.001)
        for t in ("sampled", "all", "off")
    ]
    # Each run's lead and tail are measured and within the run (an estimated span may end
    # a little after it: its stages take what a timed partition's took).
    seconds = [64 * common.COLS * 4 / r["gbps"] / common.GB for r in runs]
    assert all(
        0 <= r["lead_s"] < s and abs(r["tail_s"]) < s for r, s in zip(runs, seconds, strict=True)
    )
    assert all(r["correct"] and r["gbps"] > 0 for r in runs)
    # A wrong expectation is seen as wrong: the check compares values.
    wrong = copy_streams.library_runs(args, host, 16, func, expect + 1)
    assert not any(r["correct"] for r in wrong)


def test_copy_streams_timing_modes_time_every_sub_chunk_some_or_none(monkeypatch):
    """``all`` marks every sub-chunk of a cut partition, ``off`` none, ``sampled`` (the
    library's own rule) the call's first and then one a period; each run is right."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    sys.path.insert(0, str(BENCHMARKS / "diagnostics"))
    import copy_streams
    import dask.array as da
    import numpy as np

    import dask_overlap
    from dask_overlap.pipeline import sampling

    monkeypatch.setattr(sampling, "SAMPLE_SECONDS", 3600.0)  # one timed, in any test run
    rt = dask_overlap.get_runtime("host")
    monkeypatch.setattr(rt, "sampler", sampling.StageSampler())
    marks: list[int] = []
    mark = rt.backend.mark
    monkeypatch.setattr(rt.backend, "mark", lambda s: marks.append(1) or mark(s))
    a = np.arange(64 * 16, dtype=np.float32).reshape(64, 16)
    counted = {}
    for mode in ("sampled", "all", "off"):
        y = dask_overlap.map_blocks(
            np.negative,
            da.from_array(a, chunks=(32, 16)),
            split_axis=0,
            sub_chunk_bytes=8 * 16 * 4,
            in_flight=1,  # each sub-chunk learned before the next starts
        )
        marks.clear()
        with copy_streams.timing(mode):
            np.testing.assert_array_equal(y.compute(scheduler="sync"), -a)
        counted[mode] = len(marks) // 4
    # 2 partitions of 4 sub-chunks each; sampled: the first one of the call only.
    assert counted == {"sampled": 1, "all": 8, "off": 0}


def copy_streams_work():
    from dask_overlap.pipeline.work import PartitionWork

    return PartitionWork


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--switch-intervals", "0.005,0"], "expected positive seconds (a comma list)"),
        (["--streams", "0"], "--streams: expected an integer of at least 1, got '0'"),
        (["--window", "0"], "--window: expected an integer of at least 1, got '0'"),
        (["--in-flight", "4", "0"], "--in-flight: expected an integer of at least 1, got '0'"),
    ],
)
def test_copy_streams_refuses_bad_arguments_before_any_work(argv, words):
    script = BENCHMARKS / "diagnostics" / "copy_streams.py"
    out = subprocess.run([sys.executable, str(script), *argv], capture_output=True, text=True)
    assert out.returncode == 2 and words in out.stderr


@pytest.mark.timeout(180)
def test_demo_gap_no_trim_starts_its_worker_without_the_nannys_trim(monkeypatch):
    """``demo_gap.py``'s ``no-trim`` variant: its worker runs without
    ``MALLOC_TRIM_THRESHOLD_`` (as the threaded reference's process does), though a nanny
    started before it, in the same process, left the variable in ``os.environ``; the
    demo's own cluster (``as-is``) gets distributed's 64 KiB."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.setenv("DASK_OVERLAP__BACKEND", "host")
    monkeypatch.delenv("MALLOC_TRIM_THRESHOLD_", raising=False)
    sys.path.insert(0, str(BENCHMARKS / "diagnostics"))
    import demo_gap

    rows, rows_per_part = 64 * 1024 // demo_gap.COLS, 16 * 1024 // demo_gap.COLS
    (as_is,) = demo_gap.run_variant("as-is", rows, rows_per_part, 1)
    assert as_is["worker_trim"] == ["65536"] and as_is["seconds"] > 0
    (no_trim,) = demo_gap.run_variant("no-trim", rows, rows_per_part, 1)
    assert no_trim["worker_trim"] == ["None"] and no_trim["seconds"] > 0
    for run in (as_is, no_trim):
        # every task's compute found in the worker's records, on one thread at a time
        p = run["phases"]
        assert run["computes"] == rows // rows_per_part
        assert p["span_ms"] > 0 and 0 < p["busy"] <= 1 and p["hop_max_ms"] >= p["hop_mean_ms"] >= 0
