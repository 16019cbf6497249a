"""Setting a cluster up for dask_overlap: the worker plugin and the ``/overlap`` page."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from ..cluster.plugin import OverlapPlugin
from .scheduler_plugin import OverlapSchedulerPlugin

if TYPE_CHECKING:
    from distributed import Client

__all__ = ["register", "register_with_scheduler"]

logger = logging.getLogger(__name__)


def register(
    client: Client, options: Any = None, *, dashboard: bool = True, **overrides: Any
) -> None:
    """Set a cluster up for dask_overlap: the worker plugin, and the ``/overlap`` page.

    Registers an :class:`~dask_overlap.OverlapPlugin` (built from ``options`` and
    ``overrides``) on every worker, and, with ``dashboard``, an
    :class:`OverlapSchedulerPlugin` on the scheduler (a no-op if one is there already).
    :class:`~dask_overlap.LocalGPUCluster` and ``dask overlap worker`` do this themselves.

    Examples
    --------
    >>> import dask_overlap
    >>> dask_overlap.register(client, in_flight=2)  # doctest: +SKIP
    """
    client.register_plugin(OverlapPlugin(options, **overrides))
    if dashboard:
        client.register_plugin(OverlapSchedulerPlugin())


async def register_with_scheduler(address: str, connection_args: dict | None = None) -> bool:
    """Add the ``/overlap`` page to the scheduler at ``address`` (idempotent), over RPC.

    For processes that reach a scheduler without a client (``dask overlap worker``).
    Returns ``False``, with a warning, if the scheduler refuses (e.g. it cannot import
    dask_overlap).
    """
    from distributed.core import rpc
    from distributed.protocol.pickle import dumps

    plugin = OverlapSchedulerPlugin()
    try:
        async with rpc(address, connection_args=connection_args or {}) as scheduler:
            await scheduler.register_scheduler_plugin(
                plugin=dumps(plugin), name=plugin.name, idempotent=True
            )
    except Exception as e:
        logger.warning(
            "dask_overlap: could not add /overlap to the scheduler at %s: %s", address, e
        )
        return False
    return True
