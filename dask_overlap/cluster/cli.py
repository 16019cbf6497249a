"""The ``dask overlap`` command (also ``dask-overlap`` and ``python -m dask_overlap``).

``dask overlap worker SCHEDULER_ADDRESS`` starts one worker process per local GPU, each
with an :class:`~dask_overlap.OverlapPlugin` and, with ``overlap.cpu-affinity``, kept to
its GPU's cores, talking over ``--protocol`` (or the scheme of the scheduler's address,
e.g. ``ucxx://``; see :mod:`dask_overlap.cluster.ucx`); ``dask overlap demo`` runs the demo.
The flags for runtime options are made from the options' schema, so each option is
defined and documented once, in ``overlap.yaml`` and ``overlap.schema.json``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Callable
from typing import Any

import click
import dask.config
from distributed import Nanny

from .. import __version__
from ..config import Options
from ..dashboard import register_with_scheduler
from .local import THREADS_PER_WORKER, WorkerLayout, plan_workers, worker_memory_limit
from .plugin import OverlapPlugin, resolve_options
from .ucx import check_protocol, is_ucx, protocols, require_ucx, scheme_of

__all__ = ["main", "options_from_params", "worker_protocol"]

logger = logging.getLogger(__name__)

_CONTEXT = {"help_option_names": ["-h", "--help"], "max_content_width": 100}

# Seconds between the lines that say the workers still wait for their scheduler.
WAIT_NOTICE_SECONDS = 10.0


def _schema() -> dict[str, Any]:
    with open(os.path.join(os.path.dirname(__file__), os.pardir, "overlap.schema.json")) as f:
        return json.load(f)["properties"]["overlap"]["properties"]


class _IntOrWords(click.ParamType):
    """An integer of at least ``minimum``, or one of ``words``: a schema's ``oneOf`` of an
    integer and constants (``staging-threads``: a count or ``auto``)."""

    name = "integer"

    def __init__(self, minimum: int | None, words: tuple[str, ...]):
        self.minimum, self.words = minimum, words

    def get_metavar(self, param: click.Parameter, ctx: click.Context | None = None) -> str:
        return f"[INTEGER|{'|'.join(self.words)}]"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if value in self.words or isinstance(value, int):
            return value
        try:
            number = int(value)
        except (TypeError, ValueError):
            number = None
        if number is None or (self.minimum is not None and number < self.minimum):
            least = "" if self.minimum is None else f" of at least {self.minimum}"
            self.fail(
                f"expected an integer{least} or {' or '.join(self.words)}, got {value!r}",
                param,
                ctx,
            )
        return number


def _flag_type(spec: dict[str, Any]) -> click.ParamType:
    """The click type of an option whose schema is ``spec``."""
    if "enum" in spec:
        return click.Choice(spec["enum"])
    if spec.get("type") == "integer":
        return click.IntRange(min=spec.get("minimum"))
    branches = spec.get("oneOf", ())
    numbers = [b for b in branches if b.get("type") == "integer"]
    words = tuple(b["const"] for b in branches if "const" in b)
    if numbers and words:
        return _IntOrWords(numbers[0].get("minimum"), words)
    return click.STRING


def _option_flags(command: Callable[..., Any]) -> Callable[..., Any]:
    """One ``--flag`` per runtime option but ``timed`` (``--key/--no-key`` for a boolean),
    typed and documented by the schema."""
    schema = _schema()
    for field in reversed(dataclasses.fields(Options)):
        key = field.name.replace("_", "-")
        if key not in schema or schema[key].get("type") == "object" or key == "fuse":
            continue  # (fuse: read where a graph is optimized, on the client)
        spec = schema[key]
        default = dask.config.get(f"overlap.{key}")
        help_text = f"{spec.get('description', '')} [default: overlap.{key} = {default}]"
        if spec.get("type") == "boolean":
            command = click.option(f"--{key}/--no-{key}", field.name, default=None, help=help_text)(
                command
            )
            continue
        command = click.option(
            f"--{key}", field.name, type=_flag_type(spec), default=None, help=help_text
        )(command)
    return command


def _scheduler_file_address(path: str | None) -> str | None:
    """The address in a scheduler file that exists already (``None`` otherwise: the
    nannies wait for it, and take the scheme from it then)."""
    if not path:
        return None
    try:
        with open(path) as f:
            return json.load(f).get("address")
    except (OSError, ValueError, AttributeError):
        return None


def worker_protocol(
    protocol: str | None, scheduler: str | None, scheduler_file: str | None
) -> str | None:
    """The protocol the workers will talk over, checked: ``--protocol``, else the scheme of
    the scheduler's address (as distributed picks it), else ``None`` (``tcp``).

    Examples
    --------
    >>> worker_protocol(None, "ucxx://10.0.0.1:8786", None)
    'ucxx'
    >>> worker_protocol("tcp", "ucxx://10.0.0.1:8786", None)
    'tcp'
    """
    scheme = check_protocol(scheme_of(scheduler), name="the scheme of SCHEDULER_ADDRESS")
    if scheme is None:
        scheme = scheme_of(_scheduler_file_address(scheduler_file))
    return check_protocol(protocol, name="--protocol") or scheme


def options_from_params(**params: Any) -> Options:
    """The :class:`~dask_overlap.Options` that parsed ``worker`` flags stand for.

    Flags left out fall back to ``overlap.*`` in the configuration, exactly as
    :class:`~dask_overlap.OverlapPlugin` and :class:`~dask_overlap.LocalGPUCluster` do.

    Examples
    --------
    >>> options_from_params(in_flight=3, scheduler="tcp://a:8786").in_flight
    3
    """
    names = {f.name for f in dataclasses.fields(Options)}
    return resolve_options(**{k: v for k, v in params.items() if k in names})


@click.group(name="overlap", context_settings=_CONTEXT)
@click.version_option(__version__, prog_name="dask_overlap")
def main() -> None:
    """dask_overlap: GPU workers that run each partition as an assembly line.

    Runtime options come from the Dask configuration (overlap.*, e.g. the environment
    variable DASK_OVERLAP__IN_FLIGHT=2); the flags of each command override them.
    """


@main.command(
    name="worker",
    context_settings=_CONTEXT,
    short_help="Start one worker per local GPU, with its runtime, for a scheduler.",
)
@click.argument("scheduler", required=False, metavar="[SCHEDULER_ADDRESS]")
@click.option(
    "--scheduler-file",
    type=click.Path(dir_okay=False),
    help="Read the scheduler's address from this file (written by dask scheduler).",
)
@click.option(
    "--n-workers",
    type=click.IntRange(min=1),
    help="Worker processes [default: one per GPU; 2 with --allow-cpu on a machine with no "
    "GPU]. More workers than GPUs share them in turn.",
)
@click.option(
    "--nthreads",
    type=click.IntRange(min=1),
    help="Threads per worker: partitions in flight per GPU, sharing its runtime [default: "
    f"{THREADS_PER_WORKER} per GPU; with --allow-cpu on a machine with no GPU, this "
    "machine's cores shared among the workers].",
)
@click.option(
    "--cuda-visible-devices",
    help="GPUs to use, as in CUDA_VISIBLE_DEVICES [default: every GPU this machine shows].",
)
@click.option(
    "--allow-cpu",
    is_flag=True,
    help="On a machine with no GPU, start CPU workers (backend auto becomes host) instead "
    "of failing.",
)
@click.option(
    "--memory-limit",
    default="auto",
    show_default=True,
    help="Memory per worker, e.g. 32GiB, or a fraction of this machine's; 'auto' shares "
    "this machine's memory among the workers.",
)
@click.option(
    "--protocol",
    help=f"What the workers talk over: {', '.join(protocols())} [default: the scheme of "
    "SCHEDULER_ADDRESS, else tcp]. ucxx (UCX) needs dask_overlap[ucx-cuda13] or "
    "[ucx-cuda12].",
)
@click.option("--name", help="Name prefix: worker i is named NAME-i [default: its address].")
@click.option("--host", help="Address the workers listen on [default: this host's].")
@click.option("--interface", help="Network interface the workers listen on, e.g. ib0.")
@click.option(
    "--local-directory", type=click.Path(file_okay=False), help="Directory for spilled data."
)
@click.option(
    "--death-timeout",
    type=click.FloatRange(min=0, min_open=True),
    help="Seconds to wait for a scheduler before giving up [default: forever].",
)
@click.option(
    "--dashboard/--no-dashboard",
    default=True,
    show_default=True,
    help="Serve each worker's dashboard and /metrics.",
)
@click.option(
    "--dashboard-address",
    default=":0",
    show_default=True,
    help="Address of each worker's dashboard (:0 picks a free port).",
)
@_option_flags
def worker(
    scheduler: str | None,
    scheduler_file: str | None,
    n_workers: int | None,
    nthreads: int | None,
    cuda_visible_devices: str | None,
    allow_cpu: bool,
    memory_limit: str,
    protocol: str | None,
    name: str | None,
    host: str | None,
    interface: str | None,
    local_directory: str | None,
    death_timeout: float | None,
    dashboard: bool,
    dashboard_address: str,
    **option_flags: Any,
) -> None:
    """Start one worker per local GPU, each with its runtime, attached to SCHEDULER_ADDRESS.

    For a cluster over several machines: start a scheduler with `dask scheduler`, then run
    this on each machine. Stops cleanly on SIGINT or SIGTERM.
    """
    if not scheduler and not scheduler_file:
        raise click.UsageError("give SCHEDULER_ADDRESS or --scheduler-file")
    try:
        reach = scheme_of(scheduler) or scheme_of(_scheduler_file_address(scheduler_file))
        if is_ucx(reach) and protocol is not None and not is_ucx(protocol.removesuffix("://")):
            # Whatever they listen on, the workers reach the scheduler over UCX.
            require_ucx(f"the scheduler's address ({reach}://...)")
        layout = plan_workers(
            n_workers,
            cuda_visible_devices=cuda_visible_devices,
            allow_cpu=allow_cpu,
            options=options_from_params(**option_flags),
            protocol=worker_protocol(protocol, scheduler, scheduler_file),
        )
        limit = worker_memory_limit(memory_limit, layout.n_workers, name="--memory-limit")
        nthreads = nthreads or layout.threads_per_worker
    except (ValueError, TypeError, RuntimeError, ImportError) as e:
        raise click.ClickException(str(e)) from None
    where = f"GPU(s) {','.join(layout.devices)}" if layout.devices else "no GPU"
    over = f", over {layout.protocol}" if layout.protocol else ""
    click.echo(
        f"dask overlap worker: {layout.n_workers} worker(s), {nthreads} thread(s) each, "
        f"backend {layout.options.backend}, {where}{over}",
        err=True,
    )
    common = dict(
        scheduler_file=scheduler_file,
        nthreads=nthreads,
        memory_limit=limit,
        host=host,
        interface=interface,
        local_directory=local_directory,
        death_timeout=death_timeout,
        dashboard=dashboard,
        dashboard_address=dashboard_address,
        protocol=layout.protocol,
        config=layout.worker_config(),
    )
    where = f"at {scheduler}" if scheduler else f"in {scheduler_file}"
    try:
        # The nannies start UCX in this process (when it is the protocol).
        with layout.comm_config():
            asyncio.run(_serve(scheduler, layout, name, common, where))
    except TimeoutError:
        click.echo("dask overlap worker: timed out starting or reaching the scheduler", err=True)
        sys.exit(1)
    except (ValueError, TypeError, RuntimeError, OSError) as e:
        # A nanny that cannot start (an interface this host lacks, an address in use):
        # what went wrong, with what distributed says it was caused by, not a traceback.
        cause = f" ({type(e.__cause__).__name__}: {e.__cause__})" if e.__cause__ else ""
        raise click.ClickException(f"the workers could not start: {e}{cause}") from None


async def _still_waiting(where: str) -> None:
    """Say every ``WAIT_NOTICE_SECONDS`` that the workers still wait for their scheduler
    (until cancelled), so that an unreachable one is not a silent wait."""
    t0 = time.monotonic()
    while True:
        await asyncio.sleep(WAIT_NOTICE_SECONDS)
        click.echo(
            f"dask overlap worker: still waiting for the scheduler {where} "
            f"({time.monotonic() - t0:.0f} s)",
            err=True,
        )


async def _serve(
    scheduler: str | None,
    layout: WorkerLayout,
    name: str | None,
    common: dict[str, Any],
    where: str,
) -> None:
    plugin = OverlapPlugin(layout.options)
    nannies = [
        Nanny(
            scheduler,
            name=None if name is None else f"{name}-{i}",
            env=layout.env(i),
            # The CPU affinity first: it must be set before the runtime is built (see
            # dask_overlap.cluster.affinity).
            plugins=(*layout.plugins(i), plugin),
            **common,
        )
        for i in range(layout.n_workers)
    ]

    async def run_all() -> None:
        # Said once the signal handlers are in place (that task started first).
        waits = "forever" if common["death_timeout"] is None else f"{common['death_timeout']:g} s"
        click.echo(
            f"dask overlap worker: waiting for the scheduler {where} (at most: {waits}, "
            "--death-timeout; SIGINT or SIGTERM stops cleanly)",
            err=True,
        )
        notice = asyncio.create_task(_still_waiting(where))
        try:
            await asyncio.gather(*nannies)
        finally:
            notice.cancel()
        click.echo(
            f"dask overlap worker: joined the scheduler at {nannies[0].scheduler_addr}", err=True
        )
        # The scheduler's /overlap page; a warning, not a failure, if it cannot load it.
        await register_with_scheduler(nannies[0].scheduler_addr, nannies[0].connection_args)
        await asyncio.gather(*(n.finished() for n in nannies))

    signalled = asyncio.create_task(_wait_for_signal())
    running = asyncio.create_task(run_all())
    done, _ = await asyncio.wait({signalled, running}, return_when=asyncio.FIRST_COMPLETED)
    if signalled in done:
        reason = f"signal-{signalled.result()}"
        await asyncio.gather(*(n.close(timeout=10, reason=reason) for n in nannies))
        running.cancel()
        # Closing a nanny that is still reaching its scheduler fails its start (the
        # connection pool closes under it): that is the stop asked for, not an error.
        (outcome,) = await asyncio.gather(running, return_exceptions=True)
        if isinstance(outcome, BaseException) and not isinstance(outcome, asyncio.CancelledError):
            logger.debug("dask overlap worker: stopped while starting: %r", outcome)
        click.echo(f"dask overlap worker: stopped ({reason})", err=True)
    else:
        signalled.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await signalled
        running.result()


async def _wait_for_signal() -> int:
    """The first SIGINT or SIGTERM this process receives."""
    loop = asyncio.get_running_loop()
    got: asyncio.Future[int] = loop.create_future()

    def on_signal(signum: int) -> None:
        if not got.done():
            got.set_result(signum)

    sigs = (signal.SIGINT, signal.SIGTERM)
    for sig in sigs:
        try:
            loop.add_signal_handler(sig, on_signal, sig)
        except NotImplementedError:  # pragma: no cover - Windows
            signal.signal(sig, lambda s, _: loop.call_soon_threadsafe(on_signal, s))
    try:
        return await got
    finally:
        for sig in sigs:
            with contextlib.suppress(NotImplementedError):
                loop.remove_signal_handler(sig)


@main.command(
    name="demo",
    context_settings={"ignore_unknown_options": True, "help_option_names": []},
    add_help_option=False,
    short_help="Run the README's job on a local cluster (--help for its options).",
)
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def demo(args: tuple[str, ...]) -> None:
    """Run the demo; every argument, --help included, goes to the demo's own parser."""
    try:
        from ..demo import main as demo_main
    except ModuleNotFoundError as e:
        if e.name != "dask_overlap.demo":
            raise
        raise click.ClickException("this installation of dask_overlap has no demo") from None
    sys.exit(demo_main(list(args)))
