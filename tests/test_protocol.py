"""The protocol a cluster talks over (#16): ``LocalGPUCluster(protocol=)``, ``dask overlap
worker --protocol`` and UCX's transports (:mod:`dask_overlap.cluster.ucx`).

On the CPU: the protocol reaches the scheduler and the workers, a protocol no worker
process can use and UCX without ``distributed-ucxx`` are refused before anything starts,
and the UCX settings are what :mod:`dask_overlap.cluster.ucx` says. Marked ``gpu``: a UCX
cluster of two workers on the GPU (it also needs ``distributed-ucxx``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import dask
import dask.array as da
import numpy as np
import pytest
from click.testing import CliRunner
from distributed import Client, LocalCluster
from support import CLUSTER_KW, PLUGIN_OPTIONS, needs_install, poll

import dask_overlap
from dask_overlap import LocalGPUCluster, Options, runtime_stats
from dask_overlap.cluster.cli import main, worker_protocol
from dask_overlap.cluster.local import plan_workers
from dask_overlap.cluster.ucx import (
    CPU_TRANSPORTS,
    GPU_TRANSPORTS,
    UCXSettings,
    check_protocol,
    device_memory_resource,
    protocols,
    ucx_settings,
)

CPU = dict(allow_cpu=True, cuda_visible_devices="")
CLI_CPU = ["--allow-cpu", "--cuda-visible-devices", ""]
GPU_UCX_TLS = "tcp,sm,self,cuda_copy,cuda_ipc"
GPU_WORKER_CONFIG = {
    "distributed-ucxx.create-cuda-context": True,
    "distributed.worker.transfer.message-bytes-limit": 2**30,
}
INSTALL = (
    r"needs distributed-ucxx, which is not installed: "
    r"pip install 'dask_overlap\[ucx-cuda13\]' for a CUDA 13 driver \(distributed-ucxx-cu13\), "
    r"or 'dask_overlap\[ucx-cuda12\]' for CUDA 12 \(distributed-ucxx-cu12\)"
)


def func(b: Any) -> Any:
    return b * 2 + 1


def add_to_host(a: Any, b: Any) -> np.ndarray:
    """``a + b`` as a NumPy array (CuPy blocks are copied back)."""
    out = a + b
    return out if isinstance(out, np.ndarray) else out.get()


def upstream_resource() -> str:
    """The kind of RMM resource under this process's statistics adaptor."""
    import rmm

    return type(rmm.mr.get_current_device_resource().upstream_mr).__name__


def incoming_transfers(dask_worker: Any) -> int:
    return dask_worker.state.transfer_incoming_count_total


def env_of(key: str) -> str | None:
    return os.environ.get(key)


def device_resource_of(dask_worker: Any) -> str:
    """The device memory resource the worker's plugin built its runtime with."""
    return dask_worker.plugins["overlap"].runtime(dask_worker).options.device_memory_resource


@pytest.fixture
def without_ucx(monkeypatch: pytest.MonkeyPatch) -> None:
    """distributed-ucxx cannot be imported, whether it is installed or not."""
    monkeypatch.setitem(sys.modules, "distributed_ucxx", None)


@pytest.fixture
def fake_ucx(monkeypatch: pytest.MonkeyPatch) -> None:
    """distributed-ucxx imports (an empty stand-in): for the settings, never a cluster."""
    monkeypatch.setitem(sys.modules, "distributed_ucxx", types.ModuleType("distributed_ucxx"))


@pytest.fixture
def nothing_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail the test if a scheduler, a worker or a nanny is started."""

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("a cluster or a nanny was started")

    monkeypatch.setattr(LocalCluster, "__init__", refuse)
    monkeypatch.setattr(dask_overlap.cluster.cli, "Nanny", refuse)


# -- checked before anything starts ------------------------------------------------------
@pytest.mark.parametrize("protocol", ["carrier-pigeon", "inproc", 3])
def test_a_protocol_no_worker_process_can_use_is_refused(protocol: Any, nothing_starts) -> None:
    with pytest.raises(ValueError) as info:
        LocalGPUCluster(protocol=protocol, **CPU, **CLUSTER_KW)
    message = str(info.value)
    assert message.startswith(f"protocol must be one of {', '.join(protocols())}; ")
    assert f"got {protocol!r}" in message
    assert ("one worker process per GPU" in message) == (protocol == "inproc")


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(protocol="ucxx"),
        dict(protocol="ucx"),
        dict(protocol="ucxx://"),
        dict(host="ucxx://127.0.0.1"),  # LocalCluster takes the scheme of such a host
    ],
    ids=["ucxx", "ucx", "ucxx-url", "host"],
)
def test_ucx_without_distributed_ucxx_says_what_to_install(
    kwargs: dict[str, str], without_ucx, nothing_starts
) -> None:
    with pytest.raises(ImportError, match=r"^protocol='ucxx?' " + INSTALL):
        LocalGPUCluster(**kwargs, **CPU, **CLUSTER_KW)


@pytest.mark.parametrize(
    "args, message",
    [
        (["ucxx://127.0.0.1:1"], "protocol='ucxx' " + INSTALL),
        (["tcp://127.0.0.1:1", "--protocol", "ucx"], "protocol='ucx' " + INSTALL),
        (["tcp://127.0.0.1:1", "--protocol", "pigeon"], "--protocol must be one of .*'pigeon'"),
        # Listening on tcp, the workers still reach a ucxx:// scheduler over UCX.
        (["ucxx://127.0.0.1:1", "--protocol", "tcp"], r"address \(ucxx://...\) " + INSTALL),
        (["pigeon://127.0.0.1:1"], "the scheme of SCHEDULER_ADDRESS must be one of .*'pigeon'"),
    ],
    ids=["ucxx-address", "ucx-flag", "unknown-flag", "tcp-flag-ucxx-address", "unknown-scheme"],
)
def test_worker_refuses_a_protocol_before_starting(
    args: list[str], message: str, without_ucx, nothing_starts
) -> None:
    result = CliRunner().invoke(main, ["worker", *args, *CLI_CPU])
    assert result.exit_code == 1, result.output
    assert any(re.search(message, line) for line in result.output.splitlines()), result.output


def test_worker_protocol_is_the_flag_else_the_schedulers_scheme(tmp_path: Path) -> None:
    assert worker_protocol(None, "ucxx://10.0.0.1:8786", None) == "ucxx"
    assert worker_protocol("tcp://", "ucxx://10.0.0.1:8786", None) == "tcp"
    assert worker_protocol(None, "10.0.0.1:8786", None) is None
    path = tmp_path / "scheduler.json"
    assert worker_protocol(None, None, str(path)) is None  # not written yet
    path.write_text(json.dumps({"address": "ucx://10.0.0.1:8786"}))
    assert worker_protocol(None, None, str(path)) == "ucx"
    assert worker_protocol("ws", None, str(path)) == "ws"


# -- the UCX settings, without UCX -------------------------------------------------------
def test_ucx_settings_are_what_the_docstring_says(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in ("UCX_TLS", "UCX_SOCKADDR_TLS_PRIORITY"):
        monkeypatch.delenv(key, raising=False)
    gpu = ucx_settings(gpu=True)
    assert gpu == UCXSettings(
        CPU_TRANSPORTS + GPU_TRANSPORTS, create_cuda_context=True, message_bytes_limit=2**30
    )
    assert gpu.env() == {"UCX_TLS": GPU_UCX_TLS, "UCX_SOCKADDR_TLS_PRIORITY": "tcp"}
    assert gpu.worker_config() == GPU_WORKER_CONFIG
    with dask.config.set({"distributed-ucxx.environment": {"log-level": "info"}}):
        assert gpu.config() == {
            "distributed-ucxx.environment": {
                "log-level": "info",  # what the user had is kept
                "tls": GPU_UCX_TLS,
                "sockaddr-tls-priority": "tcp",
            },
            **GPU_WORKER_CONFIG,
        }

    cpu = ucx_settings(gpu=False)
    assert cpu.env() == {"UCX_TLS": "tcp,sm,self", "UCX_SOCKADDR_TLS_PRIORITY": "tcp"}
    assert cpu.worker_config() == {}
    assert cpu.config() == {
        "distributed-ucxx.environment": {"tls": "tcp,sm,self", "sockaddr-tls-priority": "tcp"}
    }


@pytest.mark.parametrize(
    "environ, settings",
    [
        ({"UCX_TLS": "all"}, {}),
        ({}, {"distributed-ucxx.nvlink": True}),
        ({}, {"distributed.comm.ucx.infiniband": False}),  # dask-cuda's older keys
        ({}, {"distributed-ucxx.environment": {"tls": "rc,tcp"}}),
    ],
    ids=["UCX_TLS", "switch", "legacy-switch", "environment"],
)
def test_transports_the_user_chose_are_left_alone(
    environ: dict[str, str], settings: dict[str, Any]
) -> None:
    with dask.config.set(settings):
        chosen = ucx_settings(gpu=True, environ=environ)
        assert chosen.env() == {}
        # What the user had is not replaced; the CUDA context is still asked for.
        assert chosen.config() == GPU_WORKER_CONFIG


def test_a_fetch_limit_the_user_set_is_kept() -> None:
    """On a GPU over UCX, workers fetch up to 1 GiB a request from a peer, unless the user
    set distributed's limit (in any way Dask reads its settings)."""
    key = "distributed.worker.transfer.message-bytes-limit"
    assert ucx_settings(gpu=True, environ={}).worker_config()[key] == 2**30
    assert key not in ucx_settings(gpu=False, environ={}).worker_config()
    with dask.config.set({key: "10MB"}):
        assert key not in ucx_settings(gpu=True, environ={}).worker_config()


def test_a_ucx_layout_carries_the_transports(fake_ucx, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("UCX_TLS", raising=False)
    host = Options.from_config(backend="host")
    gpu = plan_workers(cuda_visible_devices="0,1", options=host, protocol="ucxx")
    assert gpu.protocol == "ucxx"
    assert gpu.env(1) == {
        "CUDA_VISIBLE_DEVICES": "1,0",
        "UCX_TLS": GPU_UCX_TLS,
        "UCX_SOCKADDR_TLS_PRIORITY": "tcp",
    }
    assert gpu.worker_config() == GPU_WORKER_CONFIG
    with gpu.comm_config():
        assert dask.config.get("distributed-ucxx.environment.tls") == GPU_UCX_TLS
        assert dask.config.get("distributed-ucxx.create-cuda-context") is True
    assert dask.config.get("distributed-ucxx.environment.tls", None) is None

    cpu = plan_workers(**CPU, protocol="ucx")
    assert cpu.env(0)["UCX_TLS"] == "tcp,sm,self" and cpu.worker_config() == {}

    tcp = plan_workers(**CPU, protocol="tcp")
    assert (tcp.protocol, tcp.ucx, tcp.env(0), tcp.worker_config()) == ("tcp", None, {}, {})
    with tcp.comm_config():
        assert dask.config.get("distributed-ucxx", None) is None
    assert check_protocol("tcp://") == "tcp" and plan_workers(**CPU).protocol is None


# -- the protocol reaches the processes --------------------------------------------------
@pytest.mark.parametrize("protocol", ["tcp", "ws"])
def test_local_gpu_cluster_protocol_reaches_scheduler_and_workers(protocol: str) -> None:
    with (
        LocalGPUCluster(protocol=protocol, **CPU, **CLUSTER_KW) as cluster,
        Client(cluster, set_as_default=False) as client,
    ):
        assert cluster.scheduler_address.startswith(f"{protocol}://")
        workers = list(client.scheduler_info()["workers"])
        assert len(workers) == 2 and all(w.startswith(f"{protocol}://") for w in workers)
        x = da.random.random((1000, 64), chunks=(125, 64))
        got, expected = client.compute([dask_overlap.map_blocks(func, x), func(x)], sync=True)
        np.testing.assert_array_equal(got, expected)
        assert all(s["partitions"] > 0 for s in client.run(runtime_stats).values())
        # overlap.device-memory-resource "auto" (the default): CUDA's async pool off UCX
        assert set(client.run(device_resource_of).values()) == {"async"}


def test_auto_device_memory_resource_is_pool_only_on_ucx() -> None:
    assert dask.config.get("overlap.device-memory-resource") == "auto"
    for address, resource in [
        ("ucxx://10.0.0.1:40000", "pool"),
        ("ucx://10.0.0.1:40000", "pool"),
        ("tcp://10.0.0.1:40000", "async"),
        ("ws://10.0.0.1:40000", "async"),
        (None, "async"),
    ]:
        assert device_memory_resource("auto", address) == resource, address
    for chosen in ("async", "pool"):  # a named resource is kept, on UCX too
        assert device_memory_resource(chosen, "ucxx://10.0.0.1:40000") == chosen
    with pytest.raises(ValueError, match="device_memory_resource must be one of auto, async"):
        Options.from_config(device_memory_resource="cudaMalloc")


def test_ucx_settings_reach_the_worker_processes() -> None:
    """What a UCX layout gives each worker (environment and Dask settings) reaches the
    process, here over TCP: the transports are set by hand, UCX itself is not needed."""
    with (
        LocalGPUCluster(protocol="tcp", **CPU, **CLUSTER_KW) as cluster,
        Client(cluster, set_as_default=False) as client,
    ):
        ucx = UCXSettings(CPU_TRANSPORTS, create_cuda_context=True)
        cluster.layout = dataclasses.replace(cluster.layout, ucx=ucx)
        cluster.scale(3)
        client.wait_for_workers(3, timeout=60)
        seen = client.run(
            lambda dask_worker: (
                dask_worker.name,
                os.environ.get("UCX_TLS"),
                dask.config.get("distributed-ucxx.create-cuda-context", None),
            )
        )
        before = os.environ.get("UCX_TLS")  # workers 0 and 1 inherit this process's
        assert sorted(seen.values()) == [
            (0, before, None),
            (1, before, None),
            (2, "tcp,sm,self", True),
        ]


@needs_install
def test_worker_protocol_flag_reaches_the_worker(tmp_path: Path) -> None:
    # The scheduler talks WebSockets: a worker that listens on tcp:// took --protocol
    # (without it, it would take the scheduler's scheme).
    log_path = tmp_path / "worker.log"
    with (
        LocalCluster(n_workers=0, protocol="ws", dashboard_address=None) as cluster,
        Client(cluster, set_as_default=False) as client,
        open(log_path, "w") as log,
    ):
        cmd = ["-m", "dask", "overlap", "worker", cluster.scheduler_address, "--protocol", "tcp"]
        cmd += [*CLI_CPU, "--n-workers", "1", "--no-dashboard", "--name", "cli"]
        cmd += ["--local-directory", str(tmp_path)]
        proc = subprocess.Popen([sys.executable, *cmd], stdout=log, stderr=subprocess.STDOUT)
        try:
            client.wait_for_workers(1, timeout=60)
            (address,) = client.scheduler_info()["workers"]
            assert address.startswith("tcp://"), address
            x = da.random.random((1000, 64), chunks=(250, 64))
            # np.sqrt: the worker's process cannot import this module.
            ours = dask_overlap.map_blocks(np.sqrt, x)
            got, expected = client.compute([ours, da.sqrt(x)], sync=True)
            np.testing.assert_array_equal(got, expected)

            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=30) == 0
            poll(lambda: not client.scheduler_info()["workers"], 20, what="the worker gone")
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    text = log_path.read_text()
    assert "over tcp" in text and "Traceback" not in text, text


# -- on the GPU, with distributed-ucxx ---------------------------------------------------
def message_bytes_limit(dask_worker: Any) -> float:
    return dask_worker.state.transfer_message_bytes_limit


@pytest.mark.gpu
def test_ucxx_cluster_computes_across_two_workers() -> None:
    pytest.importorskip("distributed_ucxx")
    with (
        LocalGPUCluster(
            n_workers=2, protocol="ucxx", **PLUGIN_OPTIONS["cuda"], **CLUSTER_KW
        ) as cluster,
        Client(cluster, set_as_default=False) as client,
    ):
        assert cluster.scheduler_address.startswith("ucxx://")
        workers = list(client.scheduler_info()["workers"])
        assert all(w.startswith("ucxx://") for w in workers), workers
        ours = ucx_settings(gpu=True).env().get("UCX_TLS", os.environ.get("UCX_TLS"))
        assert set(client.run(env_of, "UCX_TLS").values()) == {ours}
        # memory UCX can send by CUDA IPC: RMM's pool over cudaMalloc, not cudaMallocAsync
        assert set(client.run(device_resource_of).values()) == {"pool"}
        assert set(client.run(upstream_resource).values()) == {"PoolMemoryResource"}
        # device chunks are fetched several to a request (see UCX_GPU_MESSAGE_BYTES)
        assert set(client.run(message_bytes_limit).values()) == {2**30}

        x = da.random.random((4096, 512), chunks=(256, 512))
        # A partition a block (batch=1): the count below is of partitions, one a block.
        host = dask_overlap.map_blocks(func, x, split_axis=0, batch=1)
        device = dask_overlap.map_blocks(func, x, split_axis=0, out="device", batch=1)
        x, host, device = client.persist([x, host, device])
        xn = client.compute(x, sync=True)
        stats = client.run(runtime_stats)
        assert {s["backend"] for s in stats.values()} == {"cuda"}
        assert sum(s["partitions"] for s in stats.values()) == 32

        # A block of each kind added to itself on the worker that does not hold it: it
        # crosses between the workers over UCX (a host buffer by shared memory, a device
        # one by CUDA IPC). Before anything gathers the arrays: each block has one holder.
        for arr in (host, device):
            block = client.futures_of(arr)[0]
            (holder,) = client.who_has(block)[block.key]
            (other,) = set(workers) - {holder}
            before = client.run(incoming_transfers)
            twice = client.submit(add_to_host, block, block, workers=[other], pure=False)
            i = block.key[1]
            np.testing.assert_allclose(twice.result(), 2 * func(xn[i * 256 : (i + 1) * 256]))
            after = client.run(incoming_transfers)
            assert after[other] > before[other], (before, after)
        np.testing.assert_allclose(client.compute(host, sync=True), func(xn))
