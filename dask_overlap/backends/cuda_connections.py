"""How many hardware work queues the CUDA driver opens for a process: one per stream of ours.

A stream is a software queue; the driver maps the streams of a context onto its
*connections*, hardware queues that the GPU reads in order, ``CUDA_DEVICE_MAX_CONNECTIONS``
of them (8 unless set, 32 at most). Two streams that share a connection share its order:
a sub-chunk's copy-out, enqueued on one stream behind its kernel, holds up the next
sub-chunk's copy-in on a stream that maps onto the same connection, although the copy
engine it needs is idle. The runtime leases ``overlap.streams`` (16) streams, and more are
alive beside them (the pools' own), so the driver's 8 fold them onto each other.

The driver reads the variable when it makes a context. :func:`ensure_connections` sets it
in this process while no context exists yet (the cuda backend asks it first, before any
call that makes one); :func:`connections_env` gives it to the worker processes a cluster
starts. A value the user set is left alone (``CUDA_DEVICE_MAX_CONNECTIONS=1``, say, where
kernels must run in the order they were enqueued).

This module imports neither CuPy nor RMM: the clusters' layouts ask it on machines with no
GPU too.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

__all__ = ["CONNECTIONS", "VARIABLE", "connections_env", "ensure_connections"]

VARIABLE = "CUDA_DEVICE_MAX_CONNECTIONS"

#: The driver's most: 16 leased streams, the pools' streams and the legacy default one
#: each keep a connection of their own.
CONNECTIONS = 32


def connections_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The variable for a process started from this one: none where ``environ``
    (default ``os.environ``, which the process inherits) sets it already.

    Examples
    --------
    >>> connections_env({})
    {'CUDA_DEVICE_MAX_CONNECTIONS': '32'}
    >>> connections_env({"CUDA_DEVICE_MAX_CONNECTIONS": "8"})
    {}
    """
    environ = os.environ if environ is None else environ
    return {} if VARIABLE in environ else {VARIABLE: str(CONNECTIONS)}


def ensure_connections() -> str:
    """Set the variable in this process unless it is set; its value now. It takes effect
    for contexts made from now on (in a process that has made none: the cuda backend's
    first)."""
    return os.environ.setdefault(VARIABLE, str(CONNECTIONS))
