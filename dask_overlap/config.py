"""Configuration: the ``overlap.*`` namespace of ``dask.config`` and the options objects.

Each option is defined, documented and defaulted once, in ``overlap.yaml`` beside this
module (its schema is ``overlap.schema.json``). :class:`Options` reads it, keyword
arguments override it, and every value is validated here, at the API boundary, with a
message that names the parameter, the expectation and the value given.
"""

from __future__ import annotations

import dataclasses
import math
import os
import threading
from numbers import Integral, Real
from typing import Any

import dask.config
import yaml
from dask.utils import parse_bytes, parse_timedelta

__all__ = ["BACKENDS", "Options", "TimedModel", "check_positive_int", "check_bytes"]

BACKENDS = ("auto", "cuda", "host", "timed")
DEVICE_MEMORY_RESOURCES = ("auto", "async", "pool")

_here = os.path.dirname(__file__)
with open(os.path.join(_here, "overlap.yaml")) as f:
    defaults: dict[str, Any] = yaml.safe_load(f)

# Registers the shipped defaults under user settings (update_defaults keeps what the
# user's own YAML or environment already set).
dask.config.update_defaults(defaults)


def check_positive_int(name: str, value: Any) -> int:
    """Return ``value`` as an int, or raise naming ``name`` if it is not a positive integer."""
    if isinstance(value, bool) or not isinstance(value, Integral) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


def check_bytes(name: str, value: Any, *, allow_zero: bool = False) -> int:
    """Parse a byte count (``int`` or a string such as ``"32MiB"``) named ``name``.

    >>> check_bytes("pinned_pool_size", "-1", allow_zero=True)
    Traceback (most recent call last):
    ...
    ValueError: pinned_pool_size must be a number of bytes >= 0 (e.g. 32MiB), got '-1'
    """
    expected = "a number of bytes >= 0" if allow_zero else "a positive number of bytes"
    error = ValueError(f"{name} must be {expected} (e.g. 32MiB), got {value!r}")
    if isinstance(value, bool):
        raise error
    if isinstance(value, str):
        try:
            parsed = parse_bytes(value)
        except (ValueError, TypeError, OverflowError):  # OverflowError: "1e400"
            raise error from None
    elif isinstance(value, Integral):
        parsed = int(value)
    else:
        raise error
    if parsed < 0 or (parsed == 0 and not allow_zero):
        raise error
    return parsed


def _check_choice(name: str, value: Any, choices: tuple[str, ...]) -> str:
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}; got {value!r}")
    return value


def _bytes_or_auto(name: str, value: Any, *, allow_zero: bool = False) -> int | str:
    return "auto" if value == "auto" else check_bytes(name, value, allow_zero=allow_zero)


def _check_threads(name: str, value: Any) -> int | str:
    if value == "auto":
        return "auto"
    if isinstance(value, bool) or not isinstance(value, Integral) or value < 1:
        raise ValueError(f"{name} must be a positive integer or 'auto', got {value!r}")
    return int(value)


def _check_seconds(name: str, value: Any) -> float:
    """A positive duration: seconds, or a string such as ``"10 minutes"``."""
    try:
        seconds = parse_timedelta(value, default="seconds")
    except (ValueError, TypeError, KeyError):
        seconds = None
    # At most what a thread's wait may be given (threading.TIMEOUT_MAX, about 292 years).
    if isinstance(value, bool) or seconds is None or not 0 < seconds <= threading.TIMEOUT_MAX:
        raise ValueError(f"{name} must be a positive duration (e.g. '10 minutes'), got {value!r}")
    return float(seconds)


def _check_bool(name: str, value: Any) -> bool:
    # A string too: DASK_OVERLAP__CPU_AFFINITY=false reaches dask.config as "false".
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be true or false, got {value!r}")
    return value


def _check_rate(name: str, value: Any) -> float:
    return float(check_bytes(name, value))


@dataclasses.dataclass(frozen=True)
class TimedModel:
    """Modelled stage rates of the ``timed`` backend (bytes per second, seconds per call)."""

    h2d_bandwidth: float
    d2h_bandwidth: float
    pageable_h2d_bandwidth: float
    pageable_d2h_bandwidth: float
    staging_bandwidth: float
    kernel_bandwidth: float
    kernel_seconds: float

    @classmethod
    def from_config(cls, **overrides: Any) -> TimedModel:
        values: dict[str, Any] = {}
        for field in dataclasses.fields(cls):
            key = field.name.replace("_", "-")
            value = overrides.get(field.name)
            if value is None:
                value = dask.config.get(f"overlap.timed.{key}")
            if field.name == "kernel_seconds":
                if (
                    isinstance(value, bool)
                    or not isinstance(value, Real)
                    or not 0 <= value < math.inf  # nan and inf too
                ):
                    raise ValueError(
                        f"overlap.timed.kernel-seconds must be a number >= 0, got {value!r}"
                    )
                values[field.name] = float(value)
            else:
                values[field.name] = _check_rate(f"overlap.timed.{key}", value)
        return cls(**values)

    def kernel_time(self, nbytes: int) -> float:
        return self.kernel_seconds + nbytes / self.kernel_bandwidth


@dataclasses.dataclass(frozen=True)
class Options:
    """Every option of a runtime and of a call, resolved and validated.

    Built by :meth:`from_config`, which reads ``overlap.*`` from ``dask.config`` and lets
    keyword arguments override it. The runtime, the plugin and the CLI take this object;
    none of them restates a default.
    """

    backend: str
    sub_chunk_bytes: int | str  # or "auto": see layout.auto_sub_chunk_bytes
    in_flight: int
    streams: int
    staging_threads: int | str  # or "auto": see copies.auto_threads
    pinned_pool_size: int
    result_pool_size: int | str  # or "auto": see pipeline.recycle.result_pool_bytes
    direct_bytes: int | str  # or "auto": see pipeline.runtime.resolve_direct_bytes
    device_pool_size: int
    device_memory_resource: str
    cpu_affinity: bool  # GPU workers keep to their GPU's cores: see cluster.affinity
    freeze_heap: bool  # gc.freeze() when a process's first runtime is built
    pinned_serialize: bool  # CuPy over TCP through the pinned pool: see cluster.serialize
    stall_timeout: float  # seconds without a completion before a partition fails
    fuse: bool  # neighbouring steps run in the partition: see graph.fusion
    timed: TimedModel

    @classmethod
    def from_config(cls, **overrides: Any) -> Options:
        """Options from ``dask.config`` (``overlap.*``), with non-``None`` overrides applied.

        Examples
        --------
        >>> Options.from_config(in_flight=2).in_flight
        2
        """
        unknown = set(overrides) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise TypeError(f"unknown option(s) {sorted(unknown)}")

        def get(name: str) -> Any:
            value = overrides.get(name)
            if value is None:
                value = dask.config.get(f"overlap.{name.replace('_', '-')}")
            return value

        backend = get("backend")
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {', '.join(BACKENDS)}; got {backend!r}")
        timed = overrides.get("timed")
        if timed is None:
            timed = TimedModel.from_config()
        elif not isinstance(timed, TimedModel):
            raise TypeError(f"timed must be a TimedModel, got {type(timed).__name__}")
        return cls(
            backend=backend,
            sub_chunk_bytes=_bytes_or_auto("sub_chunk_bytes", get("sub_chunk_bytes")),
            in_flight=check_positive_int("in_flight", get("in_flight")),
            streams=check_positive_int("streams", get("streams")),
            staging_threads=_check_threads("staging_threads", get("staging_threads")),
            pinned_pool_size=check_bytes(
                "pinned_pool_size", get("pinned_pool_size"), allow_zero=True
            ),
            result_pool_size=_bytes_or_auto(
                "result_pool_size", get("result_pool_size"), allow_zero=True
            ),
            direct_bytes=_bytes_or_auto("direct_bytes", get("direct_bytes"), allow_zero=True),
            device_pool_size=check_bytes("device_pool_size", get("device_pool_size")),
            device_memory_resource=_check_choice(
                "device_memory_resource", get("device_memory_resource"), DEVICE_MEMORY_RESOURCES
            ),
            cpu_affinity=_check_bool("cpu_affinity", get("cpu_affinity")),
            freeze_heap=_check_bool("freeze_heap", get("freeze_heap")),
            pinned_serialize=_check_bool("pinned_serialize", get("pinned_serialize")),
            stall_timeout=_check_seconds("stall_timeout", get("stall_timeout")),
            fuse=_check_bool("fuse", get("fuse")),
            timed=timed,
        )
