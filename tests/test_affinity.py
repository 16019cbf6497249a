"""GPU workers' CPU affinity and GPU counting through NVML, with a stand-in NVML (no GPU).

NVML is replaced by a small module of the same name (``FAKE_NVML`` below) whose GPUs and
CPU masks a test chooses: in this process through ``sys.modules``, in the processes of
``dask overlap worker`` through ``PYTHONPATH``. The cores it reports are a subset of
this process's own, so the workers' affinity visibly changes on any machine with two
cores or more.
"""

from __future__ import annotations

import asyncio
import dataclasses
import importlib.util
import json
import os
import subprocess
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import dask
import pytest
from click.testing import CliRunner
from distributed import Client, LocalCluster, WorkerPlugin
from support import CLUSTER_KW, needs_install

import dask_overlap.cluster.local as cluster_mod
from dask_overlap import LocalGPUCluster, Options, OverlapPlugin
from dask_overlap.cluster.affinity import (
    CPUAffinity,
    gpu_cores,
    nvml_cores,
    restrict,
    unpack_bitmask,
)
from dask_overlap.cluster.cli import main, options_from_params
from dask_overlap.cluster.local import WorkerLayout, plan_workers, visible_gpus
from dask_overlap.cluster.plugin import resolve_options

HOST = dict(backend="host", pinned_pool_size="16MiB", streams=2)
CORES = sorted(os.sched_getaffinity(0))

# One core of this machine for GPU 0 and another for GPU 1: a real change of affinity.
needs_two_cores = pytest.mark.skipif(len(CORES) < 2, reason="needs two cores to restrict to one")
NEAR = {0: [CORES[-1]], 1: [CORES[0]]}

FAKE_NVML = '''
"""A stand-in for pynvml: GPUs (UUID, CPU masks, MIG instances) from $FAKE_NVML."""
import json
import os


class NVMLError(Exception):
    pass


class NVMLError_LibraryNotFound(NVMLError):
    pass


GPUS = json.loads(os.environ.get("FAKE_NVML", "[]"))
FAIL_INIT = False
calls = {"init": 0, "shutdown": 0}


def nvmlInit():
    if FAIL_INIT:
        raise NVMLError_LibraryNotFound("NVML Shared Library Not Found")
    calls["init"] += 1


def nvmlShutdown():
    calls["shutdown"] += 1


def nvmlDeviceGetCount():
    return len(GPUS)


def nvmlDeviceGetHandleByIndex(i):
    if not 0 <= i < len(GPUS):
        raise NVMLError("Invalid Argument")
    return ("gpu", i)


def nvmlDeviceGetHandleByUUID(uuid):
    for i, gpu in enumerate(GPUS):
        if gpu["uuid"] == uuid:
            return ("gpu", i)
        if uuid in gpu.get("migs", ()):
            return ("mig", i)
    raise NVMLError("Not Found")


def nvmlDeviceIsMigDeviceHandle(handle):
    return int(handle[0] == "mig")


def nvmlDeviceGetDeviceHandleFromMigDeviceHandle(handle):
    return ("gpu", handle[1])


def nvmlDeviceGetUUID(handle):
    return GPUS[handle[1]]["uuid"]


def nvmlDeviceGetCpuAffinity(handle, words):
    if handle[0] != "gpu":
        raise NVMLError("Not Supported")  # as NVML does for a MIG instance's handle
    masks = GPUS[handle[1]]["masks"]
    return (masks + [0] * words)[:words]
'''


def masks_of(cores: list[int]) -> list[int]:
    """64-bit words with ``cores`` set, as NVML reports them (the inverse of unpacking)."""
    words = [0] * (max(cores) // 64 + 1)
    for c in cores:
        words[c // 64] |= 1 << (c % 64)
    return words


def gpus(near: dict[int, list[int]]) -> list[dict[str, Any]]:
    return [
        {"uuid": f"GPU-{i}abc-000{i}", "masks": masks_of(cores), "migs": [f"MIG-{i}-a"]}
        for i, cores in sorted(near.items())
    ]


@pytest.fixture
def fake_nvml(monkeypatch: pytest.MonkeyPatch) -> Iterator[types.ModuleType]:
    """The stand-in NVML as ``pynvml`` in this process, with the GPUs of ``NEAR``."""
    module = types.ModuleType("pynvml")
    exec(FAKE_NVML, module.__dict__)
    module.GPUS = gpus(NEAR)
    monkeypatch.setitem(sys.modules, "pynvml", module)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    yield module
    assert module.calls["init"] == module.calls["shutdown"], "NVML left initialised"


@pytest.fixture
def no_nvml(monkeypatch: pytest.MonkeyPatch) -> None:
    """nvidia-ml-py not installed (``import pynvml`` raises ImportError)."""
    monkeypatch.setitem(sys.modules, "pynvml", None)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)


# --- the bitmask and the intersection --------------------------------------------------


def test_unpack_bitmask_of_fabricated_nvml_masks() -> None:
    assert unpack_bitmask([0b1011]) == [0, 1, 3]
    assert unpack_bitmask([1 << 63]) == [63]
    assert unpack_bitmask([0, 1]) == [64]
    assert unpack_bitmask([0xFFFF, 0xFF]) == [*range(16), *range(64, 72)]
    assert unpack_bitmask([1 + 2 + 16, 2 + 4], mask_bits=32) == [0, 1, 4, 33, 34]
    assert unpack_bitmask([]) == [] and unpack_bitmask([0, 0]) == []
    # Two sockets of 48 cores, GPU on the second: the cores 48-95 span two words.
    second = list(range(48, 96))
    assert unpack_bitmask(masks_of(second)) == second
    with pytest.raises(ValueError, match="64-bit unsigned integers, got -1 at 0"):
        unpack_bitmask([-1])
    with pytest.raises(ValueError, match=r"got 18446744073709551616 at 1"):
        unpack_bitmask([0, 1 << 64])
    with pytest.raises(ValueError, match="got '3' at 0"):
        unpack_bitmask(["3"])  # type: ignore[list-item]


def test_restrict_never_widens_the_current_affinity() -> None:
    assert restrict(CORES) == CORES
    assert restrict([*CORES, 10**6]) == CORES
    assert restrict(CORES[:1]) == CORES[:1]
    assert restrict([10**6, 10**6 + 1]) is None  # no core in common: leave it alone
    assert restrict([]) is None


def test_nvml_cores_by_index_uuid_prefix_and_mig(fake_nvml: types.ModuleType) -> None:
    assert nvml_cores(0) == nvml_cores("0") == NEAR[0]
    assert nvml_cores("1") == NEAR[1]
    assert nvml_cores("GPU-1abc-0001") == NEAR[1]
    assert nvml_cores("GPU-1abc") == NEAR[1]  # a unique prefix, as CUDA accepts
    assert nvml_cores("MIG-0-a") == NEAR[0]  # a MIG instance: its GPU's cores
    assert nvml_cores("GPU-") is None  # a prefix of both GPUs names neither
    assert nvml_cores("7") is None and nvml_cores("GPU-nope") is None


def test_gpu_cores_are_within_this_process_affinity(fake_nvml: types.ModuleType) -> None:
    others = [c for c in range(64) if c not in CORES]  # CPU ids this process may not use
    if not others:
        pytest.skip("this process may run on every CPU id below 64")
    fake_nvml.GPUS = gpus({0: sorted([*CORES, others[0]]), 1: others[:1]})
    assert nvml_cores(0) == sorted([*CORES, others[0]])
    assert gpu_cores(0) == CORES  # the core this process may not use is left out
    assert gpu_cores(1) is None  # none of its cores is: the affinity stays as it is


def test_without_nvml_no_cores(no_nvml: None, monkeypatch: pytest.MonkeyPatch) -> None:
    assert nvml_cores(0) is None and gpu_cores("0") is None
    fake = types.ModuleType("pynvml")
    exec(FAKE_NVML, fake.__dict__)
    fake.FAIL_INIT = True  # installed, but no driver
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    assert nvml_cores(0) is None


def test_the_plugin_validates_its_cores_on_the_client() -> None:
    assert CPUAffinity([3, 1, 3]).cores == [1, 3]
    for bad in ([], [-1], [True], ["0"]):
        with pytest.raises(ValueError, match="cores must be a non-empty list of CPU ids"):
            CPUAffinity(bad)  # type: ignore[arg-type]


# --- counting GPUs ---------------------------------------------------------------------


def _no_subprocess(*args: Any, **kwargs: Any) -> Any:
    raise AssertionError(f"a subprocess was started: {args}")


def test_gpus_are_counted_through_nvml(
    fake_nvml: types.ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(cluster_mod.subprocess, "run", _no_subprocess)  # neither smi nor CuPy
    assert visible_gpus() == ["0", "1"]
    layout = plan_workers(options=resolve_options(**HOST))
    assert (layout.n_workers, layout.devices) == (2, ("0", "1"))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-1abc-0001,MIG-0-a")
    assert visible_gpus() == ["GPU-1abc-0001", "MIG-0-a"]  # the variable wins, ids as given
    fake_nvml.GPUS = []
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert visible_gpus() == []
    with pytest.raises(RuntimeError, match=r"unset; NVML reports no device\).*allow_cpu"):
        plan_workers()


def test_without_nvml_gpus_are_counted_as_before_and_the_error_says_what_to_install(
    no_nvml: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    smi = "GPU 0: NVIDIA H200 (UUID: GPU-1)\nGPU 1: NVIDIA H200 (UUID: GPU-2)\n"

    def nvidia_smi(cmd: list[str], **kwargs: Any) -> Any:
        assert cmd == ["nvidia-smi", "-L"]
        return subprocess.CompletedProcess(cmd, 0, smi, "")

    monkeypatch.setattr(cluster_mod.subprocess, "run", nvidia_smi)
    assert visible_gpus() == ["0", "1"]

    def missing(cmd: list[str], **kwargs: Any) -> Any:
        raise FileNotFoundError(cmd[0])

    monkeypatch.setattr(cluster_mod.subprocess, "run", missing)
    monkeypatch.setattr(cluster_mod.importlib.util, "find_spec", lambda name: None)  # no CuPy
    assert visible_gpus() == []
    with pytest.raises(RuntimeError, match=r"pip install nvidia-ml-py.*allow_cpu=True"):
        plan_workers()


def test_nvml_that_cannot_start_falls_back(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = types.ModuleType("pynvml")
    exec(FAKE_NVML, fake.__dict__)
    fake.FAIL_INIT = True
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)

    def nvidia_smi(listed: str) -> Any:
        return lambda cmd, **kw: subprocess.CompletedProcess(cmd, 0, listed, "")

    monkeypatch.setattr(cluster_mod.subprocess, "run", nvidia_smi("GPU 0: NVIDIA H200 (UUID: x)\n"))
    assert visible_gpus() == ["0"]
    # When nvidia-smi finds none either, the error says why NVML did not count them.
    monkeypatch.setattr(cluster_mod.subprocess, "run", nvidia_smi(""))
    monkeypatch.setattr(cluster_mod.importlib.util, "find_spec", lambda name: None)  # no CuPy
    with pytest.raises(RuntimeError, match=r"NVML did not start \(NVML Shared Library Not Fou"):
        plan_workers()


# --- the option ------------------------------------------------------------------------


def test_the_option_is_on_by_default_and_can_be_turned_off() -> None:
    assert Options.from_config().cpu_affinity is True
    assert Options.from_config(cpu_affinity=False).cpu_affinity is False
    with dask.config.set({"overlap.cpu-affinity": "false"}):  # as an environment variable
        assert Options.from_config().cpu_affinity is False
    with pytest.raises(ValueError, match="cpu_affinity must be true or false, got 'off'"):
        Options.from_config(cpu_affinity="off")
    sub = main.commands["worker"]
    params = sub.make_context("worker", ["--no-cpu-affinity", "tcp://a:1"]).params
    assert options_from_params(**params).cpu_affinity is False
    params = sub.make_context("worker", ["tcp://a:1"]).params
    assert params["cpu_affinity"] is None  # not given: the configuration decides
    help_text = CliRunner().invoke(main, ["worker", "--help"]).output
    assert "--cpu-affinity / --no-cpu-affinity" in help_text


def test_each_gpu_worker_gets_its_gpus_cores_unless_turned_off(
    fake_nvml: types.ModuleType,
) -> None:
    layout = plan_workers(3, cuda_visible_devices="1,0", options=resolve_options(**HOST))
    assert [[p.cores for p in layout.plugins(i)] for i in range(3)] == [
        [NEAR[1]],
        [NEAR[0]],
        [NEAR[1]],
    ]
    off = dataclasses.replace(layout.options, cpu_affinity=False)
    assert WorkerLayout(2, ("0", "1"), off).plugins(0) == []
    with dask.config.set({"overlap.cpu-affinity": False}):
        from_config = plan_workers(cuda_visible_devices="0", options=resolve_options(**HOST))
        assert from_config.plugins(0) == []
    cpu = plan_workers(cuda_visible_devices="", allow_cpu=True, options=resolve_options(**HOST))
    assert cpu.plugins(0) == []  # the CPU path has no GPU to be near
    fake_nvml.GPUS = []
    assert layout.plugins(0) == []  # NVML does not know the GPU: left alone


# --- on real multi-process clusters ----------------------------------------------------


class AffinityProbe(WorkerPlugin):
    """What a plugin set up after CPUAffinity sees: its setup's first step, then a thread
    of the loop's executor, as OverlapPlugin builds its runtime."""

    name = "affinity-probe"

    async def setup(self, worker: Any) -> None:
        self.at_start = sorted(os.sched_getaffinity(0))
        self.in_thread = sorted(await asyncio.to_thread(os.sched_getaffinity, 0))


def thread_affinities() -> list[list[int]]:
    """The affinity of every thread of this process, distinct values."""
    seen = set()
    for tid in os.listdir("/proc/self/task"):
        try:
            seen.add(tuple(sorted(os.sched_getaffinity(int(tid)))))
        except ProcessLookupError:
            pass
    return sorted(list(s) for s in seen)


@needs_two_cores
def test_the_plugin_sets_every_worker_thread_before_later_plugins() -> None:
    core = NEAR[0]
    plugins = [CPUAffinity(core), AffinityProbe(), OverlapPlugin(**HOST)]
    with (
        LocalCluster(
            n_workers=2, threads_per_worker=2, processes=True, plugins=plugins, **CLUSTER_KW
        ) as cluster,
        Client(cluster, set_as_default=False) as client,
    ):
        assert list(client.run(os.sched_getaffinity, 0).values()) == [set(core)] * 2
        # Every thread, those Dask and the runtime started before and after it included.
        assert list(client.run(thread_affinities).values()) == [[core]] * 2
        in_task = client.submit(os.sched_getaffinity, 0, pure=False).result()
        assert sorted(in_task) == core
        probes = client.run(
            lambda dask_worker: (
                dask_worker.plugins["affinity-probe"].at_start,
                dask_worker.plugins["affinity-probe"].in_thread,
            )
        )
        assert list(probes.values()) == [(core, core)] * 2
        applied = client.run(
            lambda dask_worker: (
                dask_worker.plugins[CPUAffinity.name].applied,
                sorted(dask_worker.plugins[CPUAffinity.name].before),
            )
        )
        assert list(applied.values()) == [(core, CORES)] * 2
    assert sorted(os.sched_getaffinity(0)) == CORES  # this process: untouched


def test_cores_outside_the_worker_affinity_leave_it_alone() -> None:
    with (
        LocalCluster(
            n_workers=1,
            threads_per_worker=1,
            processes=True,
            plugins=[CPUAffinity([10**4])],
            **CLUSTER_KW,
        ) as cluster,
        Client(cluster, set_as_default=False) as client,
    ):
        assert list(client.run(os.sched_getaffinity, 0).values()) == [set(CORES)]
        applied = client.run(lambda dask_worker: dask_worker.plugins[CPUAffinity.name].applied)
        assert list(applied.values()) == [None]


@needs_two_cores
def test_local_gpu_cluster_keeps_each_worker_near_its_gpu(fake_nvml: types.ModuleType) -> None:
    # The stand-in is this process's; the workers' distributed would ask the machine's own
    # NVML, where there is one, for GPUs "0,1" names (on a machine of one GPU, it failed).
    with (
        dask.config.set({"distributed.diagnostics.nvml": False}),
        LocalGPUCluster(
            cuda_visible_devices="0,1", threads_per_worker=1, **HOST, **CLUSTER_KW
        ) as cluster,
        Client(cluster, set_as_default=False) as client,
    ):
        got = client.run(
            lambda dask_worker: (
                os.environ["CUDA_VISIBLE_DEVICES"],
                sorted(os.sched_getaffinity(0)),
                OverlapPlugin.name in dask_worker.plugins,
            )
        )
        assert sorted(got.values()) == [("0,1", NEAR[0], True), ("1,0", NEAR[1], True)]
        cluster.scale(3)  # a worker added later gets its GPU's cores too
        client.wait_for_workers(3, timeout=60)
        envs = client.run(
            lambda: (os.environ["CUDA_VISIBLE_DEVICES"], sorted(os.sched_getaffinity(0)))
        )
        assert sorted(envs.values()) == [("0,1", NEAR[0])] * 2 + [("1,0", NEAR[1])]


def test_local_gpu_cluster_with_the_option_off_leaves_affinity_alone(
    fake_nvml: types.ModuleType,
) -> None:
    with (
        LocalGPUCluster(
            cuda_visible_devices="0", cpu_affinity=False, threads_per_worker=1, **HOST, **CLUSTER_KW
        ) as cluster,
        Client(cluster, set_as_default=False) as client,
    ):
        got = client.run(
            lambda dask_worker: (
                sorted(os.sched_getaffinity(0)),
                CPUAffinity.name in dask_worker.plugins,
                dask_worker.plugins[OverlapPlugin.name].options.cpu_affinity,
            )
        )
        assert list(got.values()) == [(CORES, False, False)]


@needs_install
@needs_two_cores
def test_dask_overlap_worker_keeps_each_worker_near_its_gpu(tmp_path: Path) -> None:
    (tmp_path / "pynvml.py").write_text(FAKE_NVML)
    env = dict(os.environ)
    env.pop("CUDA_VISIBLE_DEVICES", None)
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), *sys.path])
    env["FAKE_NVML"] = json.dumps(gpus(NEAR))
    # distributed's GPU diagnostics would ask the stand-in for more than it has.
    env["DASK_DISTRIBUTED__DIAGNOSTICS__NVML"] = "False"
    with (
        LocalCluster(n_workers=0, dashboard_address=None) as cluster,
        Client(cluster, set_as_default=False) as client,
        open(tmp_path / "worker.log", "w") as log,
    ):
        cmd = [sys.executable, "-m", "dask", "overlap", "worker", cluster.scheduler_address]
        cmd += ["--cuda-visible-devices", "1,0", "--backend", "host", "--nthreads", "1"]
        cmd += ["--pinned-pool-size", "16MiB", "--no-dashboard", "--name", "cli"]
        cmd += ["--local-directory", str(tmp_path)]
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            client.wait_for_workers(2, timeout=60)
            got = client.run(
                lambda dask_worker: (
                    dask_worker.name,
                    sorted(os.sched_getaffinity(0)),
                    dask_worker.plugins[OverlapPlugin.name].options.backend,
                )
            )
            assert sorted(got.values()) == [("cli-0", NEAR[1], "host"), ("cli-1", NEAR[0], "host")]
            proc.terminate()
            assert proc.wait(timeout=30) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert "Traceback" not in (tmp_path / "worker.log").read_text()


# --- on a GPU (pytest -m gpu) ----------------------------------------------------------


def _nvml_starts() -> bool:
    if importlib.util.find_spec("pynvml") is None:
        return False
    import pynvml

    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return False
    pynvml.nvmlShutdown()
    return True


@pytest.mark.gpu
@pytest.mark.skipif(not _nvml_starts(), reason="needs nvidia-ml-py and an NVIDIA driver")
def test_real_nvml_gives_each_gpu_worker_cores_near_it() -> None:
    import pynvml

    devices = visible_gpus()
    assert devices, "NVML starts but no GPU is visible"
    for device in devices:
        cores = gpu_cores(device)
        assert cores and set(cores) <= set(CORES), (device, cores)
    # NVML's cores are those the kernel lists near the GPU's PCI slot.
    pynvml.nvmlInit()
    try:
        bus = pynvml.nvmlDeviceGetPciInfo(pynvml.nvmlDeviceGetHandleByIndex(0)).busId
        bus = (bus.decode() if isinstance(bus, bytes) else bus).lower()
    finally:
        pynvml.nvmlShutdown()
    cpulist = Path(f"/sys/bus/pci/devices/{bus[-12:]}/local_cpulist")
    if cpulist.exists():
        listed = []
        for part in cpulist.read_text().strip().split(","):
            lo, _, hi = part.partition("-")
            listed += range(int(lo), int(hi or lo) + 1)
        assert nvml_cores(0) == listed
    with (
        LocalGPUCluster(
            1, cuda_visible_devices=devices[0], threads_per_worker=1, **HOST, **CLUSTER_KW
        ) as cluster,
        Client(cluster, set_as_default=False) as client,
    ):
        (got,) = client.run(lambda: sorted(os.sched_getaffinity(0))).values()
        assert got == gpu_cores(devices[0])
