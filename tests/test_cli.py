"""``dask overlap``: help, flags, the demo hand-off, and a worker against a real scheduler."""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import re
import signal
import socket
import subprocess
import sys
import types
from pathlib import Path

import dask
import dask.array as da
import numpy as np
import pytest
from click.testing import CliRunner
from distributed import Client, LocalCluster, wait
from support import needs_install, poll, without_shutdown_noise

import dask_overlap
from dask_overlap import Options, OverlapPlugin, runtime_stats
from dask_overlap.cluster.cli import main, options_from_params
from dask_overlap.cluster.local import THREADS_PER_WORKER, plan_workers

OPTION_FLAGS = [
    f"--{f.name.replace('_', '-')}"
    for f in dataclasses.fields(Options)
    if f.name not in ("timed", "fuse")  # (fuse: the client's)
]


def reap(proc: subprocess.Popen[bytes]) -> None:
    """Kill ``proc`` if it still runs: a failed test leaves no worker behind."""
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def run(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, timeout=timeout, check=False
    )


@needs_install
def test_dask_overlap_help_through_the_dask_command() -> None:
    top = run("-m", "dask", "overlap", "--help")
    assert top.returncode == 0, top.stderr
    assert "dask overlap [OPTIONS] COMMAND" in top.stdout
    assert "worker" in top.stdout and "demo" in top.stdout
    assert "While registering" not in top.stderr  # dask found and loaded our entry point

    worker = run("-m", "dask", "overlap", "worker", "--help")
    assert worker.returncode == 0, worker.stderr
    for flag in [*OPTION_FLAGS, "--allow-cpu", "--nthreads", "--n-workers", "--memory-limit"]:
        assert flag in worker.stdout, flag
    assert "[SCHEDULER_ADDRESS]" in worker.stdout
    assert "overlap.in-flight" in worker.stdout  # defaults are read from the configuration
    assert f"[default: {THREADS_PER_WORKER} per GPU;" in " ".join(worker.stdout.split())


def test_python_m_dask_overlap_is_the_same_command() -> None:
    out = run("-m", "dask_overlap", "--help")
    assert out.returncode == 0, out.stderr
    assert "Usage: python -m dask_overlap" in out.stdout and "worker" in out.stdout


def test_demo_hands_every_argument_to_the_demo(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[list[str] | None] = []

    def demo_main(argv: list[str] | None = None) -> int:
        seen.append(argv)
        return 3

    monkeypatch.setitem(sys.modules, "dask_overlap.demo", types.SimpleNamespace(main=demo_main))
    result = CliRunner().invoke(main, ["demo", "--help", "--size", "1GiB"])
    assert result.exit_code == 3
    assert seen == [["--help", "--size", "1GiB"]]


@pytest.mark.skipif(
    importlib.util.find_spec("dask_overlap.demo") is None,
    reason="dask_overlap.demo not written yet",
)
@needs_install
def test_demo_help_is_the_demos_own() -> None:
    out = run("-m", "dask", "overlap", "demo", "--help")
    assert out.returncode == 0, out.stderr
    assert "usage:" in out.stdout.lower()


def test_options_from_config_and_from_flags_agree() -> None:
    def parse(*args: str) -> Options:
        ctx = main.commands["worker"].make_context("worker", ["tcp://a:8786", *args])
        return options_from_params(**ctx.params)

    settings = {"overlap.in-flight": 3, "overlap.pinned-pool-size": "64MiB", "overlap.streams": 2}
    with dask.config.set(settings):
        from_config = Options.from_config()
        assert parse() == from_config == OverlapPlugin().options
    from_flags = parse("--in-flight", "3", "--pinned-pool-size", "64MiB", "--streams", "2")
    assert from_flags == from_config
    assert from_flags == OverlapPlugin(in_flight=3, pinned_pool_size="64MiB", streams=2).options
    assert parse("--backend", "timed").backend == "timed"
    # A count or auto (the schema's oneOf), each as the flag's text.
    assert parse("--staging-threads", "4").staging_threads == 4
    assert parse("--staging-threads", "auto").staging_threads == "auto"
    # The CLI and LocalGPUCluster lay workers out through the same function.
    layout = plan_workers(cuda_visible_devices="", allow_cpu=True, options=from_flags)
    assert layout.options == dataclasses.replace(from_config, backend="host")


@pytest.mark.parametrize(
    "args, code, message",
    [
        (["worker"], 2, "give SCHEDULER_ADDRESS or --scheduler-file"),
        (["worker", "tcp://a:1", "--in-flight", "0"], 2, "--in-flight"),
        (["worker", "tcp://a:1", "--backend", "gpu"], 2, "--backend"),
        (["worker", "tcp://a:1", "--pinned-pool-size", "lots"], 1, "pinned_pool_size"),
        (["worker", "tcp://a:1", "--cuda-visible-devices", ""], 1, "--allow-cpu"),
        (["worker", "tcp://a:1", "--allow-cpu", "--memory-limit", "lots"], 1, "--memory-limit"),
        (["worker", "tcp://a:1", "--allow-cpu", "--memory-limit", "-1GiB"], 1, "got '-1GiB'"),
        (["worker", "tcp://a:1", "--death-timeout", "-1"], 2, "--death-timeout"),
        (["worker", "tcp://a:1", "--staging-threads", "x"], 2, "an integer of at least 1 or auto"),
        (["worker", "tcp://a:1", "--staging-threads", "0"], 2, "--staging-threads"),
    ],
)
def test_worker_rejects_bad_flags_before_starting(args: list[str], code: int, message: str) -> None:
    result = CliRunner().invoke(main, args)
    assert result.exit_code == code, result.output
    assert message in result.output


def test_worker_that_cannot_start_says_why_without_a_traceback() -> None:
    args = ["worker", "tcp://127.0.0.1:1", "--allow-cpu", "--cuda-visible-devices", ""]
    result = CliRunner().invoke(main, [*args, "--n-workers", "1", "--interface", "nosuch0"])
    assert result.exit_code == 1, result.output
    assert "the workers could not start" in result.output, result.output
    assert "'nosuch0' is not a valid network interface" in result.output, result.output
    assert result.exc_info is None or result.exc_info[0] is SystemExit


@needs_install
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_worker_joins_computes_and_stops_on_signal(sig: signal.Signals, tmp_path: Path) -> None:
    log_path = tmp_path / "worker.log"
    with (
        LocalCluster(n_workers=0, dashboard_address=None) as cluster,
        Client(cluster, set_as_default=False) as client,
        open(log_path, "w") as log,
    ):
        # --cuda-visible-devices "" makes this the CPU path even on a machine with GPUs.
        cmd = ["-m", "dask", "overlap", "worker", cluster.scheduler_address, "--allow-cpu"]
        cmd += ["--cuda-visible-devices", "", "--n-workers", "1", "--nthreads", "2"]
        cmd += ["--no-dashboard", "--name", "cli", "--in-flight", "3"]
        cmd += ["--local-directory", str(tmp_path)]
        proc = subprocess.Popen([sys.executable, *cmd], stdout=log, stderr=subprocess.STDOUT)
        try:
            client.wait_for_workers(1, timeout=60)
            info = client.run(
                lambda dask_worker: (dask_worker.name, dask_worker.plugins["overlap"].options)
            )
            assert list(info.values()) == [
                ("cli-0", Options.from_config(in_flight=3, backend="host"))
            ]

            x = da.random.random((1000, 64), chunks=(250, 64))
            ours = dask_overlap.map_blocks(np.sqrt, x, split_axis=0, sub_chunk_bytes="16KiB")
            got, expected = client.compute([ours, da.sqrt(x)], sync=True)
            np.testing.assert_array_equal(got, expected)
            assert [s["partitions"] for s in client.run(runtime_stats).values()] == [4]

            proc.send_signal(sig)
            assert proc.wait(timeout=30) == 0
            poll(
                lambda: not client.scheduler_info()["workers"],
                20,
                what="the worker leaving the scheduler",
            )
        finally:
            reap(proc)
    text = log_path.read_text()
    assert f"Reason: signal-{int(sig)}" in text, text
    assert "Traceback" not in text, text


@needs_install
def test_worker_says_what_it_waits_for_and_stops_cleanly_without_a_scheduler(
    tmp_path: Path,
) -> None:
    # A port that refuses connections: bound here, never listening.
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        address = f"tcp://127.0.0.1:{taken.getsockname()[1]}"
        log_path = tmp_path / "worker.log"
        cmd = ["-m", "dask", "overlap", "worker", address, "--allow-cpu", "--n-workers", "1"]
        cmd += ["--cuda-visible-devices", "", "--no-dashboard", "--local-directory", str(tmp_path)]
        with open(log_path, "w") as log:
            proc = subprocess.Popen([sys.executable, *cmd], stdout=log, stderr=subprocess.STDOUT)
        try:
            waiting = f"waiting for the scheduler at {address} (at most: forever"
            poll(lambda: waiting in log_path.read_text(), 60, what="the line it waits with")
            assert proc.poll() is None, log_path.read_text()  # still waiting, not failed
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=30) == 0, log_path.read_text()
        finally:
            reap(proc)
    text = log_path.read_text()
    # --nthreads left out: on the CPU path one worker gets the cores this process may use.
    assert f"1 worker(s), {len(os.sched_getaffinity(0))} thread(s) each" in text, text
    assert f"Reason: signal-{int(signal.SIGTERM)}" in text, text
    assert "stopped (signal-15)" in text, text
    assert "Traceback" not in text and "Error" not in text, text


def test_demo_defaults_are_what_its_help_says() -> None:
    from dask_overlap.demo import _parser, _setup

    text = " ".join(_parser().format_help().split())
    setup = _setup(_parser().parse_args([]), gpu=True)
    # The sub-chunk and the threads are left to the library, as the help says.
    assert setup.sub_chunk is None
    assert "default overlap.sub-chunk-bytes, now auto" in text
    assert setup.threads is None and setup.workers is None
    assert f"default {THREADS_PER_WORKER} per GPU" in text
    assert (setup.nbytes, setup.chunks) == (4 << 30, 16)  # "4GiB on a GPU", "size/16"
    cpu = _setup(_parser().parse_args([]), gpu=False)
    assert (cpu.nbytes, cpu.chunks, cpu.chunk_bytes) == (256 << 20, 16, 16 << 20)
    assert cpu.repeat == 1 and _setup(_parser().parse_args(["--repeat", "3"]), False).repeat == 3
    with pytest.raises(SystemExit):
        _parser().parse_args(["--repeat", "0"])


@pytest.mark.parametrize(
    "args, message",
    [
        (["--size", "0"], "--size: expected at least one row of 4.00 kiB, got '0'"),
        (["--size", "abc"], "--size: expected bytes such as 256MiB, got 'abc'"),
        (["--chunk=-4MiB"], "--chunk/--partition: expected at least one row"),
        (["--sub-chunk", "lots"], "--sub-chunk: expected auto or --sub-chunk must be"),
        (["--workers", "0"], "--workers: expected at least 1, got 0"),
        (["--threads=-1"], "--threads: expected at least 1, got -1"),
        (["--rounds=-3"], "--rounds: expected at least 0, got -3"),
        (["--keep-open=-5"], "--keep-open: expected 0 or more seconds"),
    ],
)
def test_demo_refuses_bad_arguments_before_a_cluster_starts(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from dask_overlap.demo import _parser

    with pytest.raises(SystemExit) as info:
        _parser().parse_args(args)
    assert info.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.timeout(300)
def test_demo_numbers_add_up(tmp_path: Path) -> None:
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")  # the CPU path, as on CI
    done = subprocess.run(
        [sys.executable, "-m", "dask_overlap", "demo", "--size", "32MiB", "--repeat", "2"],
        cwd=tmp_path,
        env=env, capture_output=True, text=True, timeout=280, check=False,
    )  # fmt: skip
    out = done.stdout
    assert done.returncode == 0, out + done.stderr[-3000:]
    stderr = without_shutdown_noise(done.stderr)
    assert "Traceback" not in stderr, stderr[-3000:]
    assert "32.00 MiB float32 in 16 chunks of 2.00 MiB, on the CPU path" in out, out
    threads = max(1, len(os.sched_getaffinity(0)) // 2)
    assert f"cluster: 2 worker(s) x {threads} thread(s)" in out, out
    # On the CPU path batch="auto" joins no chunks, and sub-chunk-bytes: auto cuts none.
    ran = "ran the 16 chunks as one partition a chunk (16 of 2.00 MiB), in 16 sub-chunks"
    assert ran in out, out
    # Counted over the timed run only: the input, once each way, not the warm-up too.
    copied = "copied in the last timed run (the warm-up left out): 32.00 MiB handed to func"
    assert copied in out and "0 B copied into outputs" in out, out
    assert "makes no copy that only a GPU needs" in out, out
    assert "result equals plain Dask: True" in out, out
    # --repeat 2: the medians of two runs, their ratio, and the ratio of each run.
    assert "until every chunk exists (median of 2 runs)" in out, out
    ratio = re.search(r"dask_overlap / plain Dask \(NumPy\): ([0-9.]+)x \(run by run: (.*)\)", out)
    assert ratio and float(ratio.group(1)) > 0 and len(ratio.group(2).split(", ")) == 2, out


@pytest.mark.timeout(120)
def test_demo_waits_until_the_workers_let_a_dropped_result_go() -> None:
    from dask.core import flatten

    from dask_overlap.demo import _held, wait_released

    with (
        LocalCluster(n_workers=2, threads_per_worker=1, dashboard_address=":0") as cluster,
        Client(cluster) as client,
    ):
        arr = client.persist(da.ones((40, 10), chunks=(10, 10)) + 1)
        wait(arr)
        keys = list(flatten(arr.__dask_keys__()))
        assert len(keys) == 4 and sum(client.run(_held, keys).values()) == 4
        # Still held by the client: nothing is let go, and the wait ends at its timeout.
        wait_released(client, keys, timeout=0.2)
        assert sum(client.run(_held, keys).values()) == 4
        assert float(arr.sum().compute()) == 800.0
        del arr
        # Let go: when the wait returns, no worker holds any chunk (no poll here).
        wait_released(client, keys, timeout=60)
        assert sum(client.run(_held, keys).values()) == 0
