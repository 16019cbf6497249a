"""The ``overlap.*`` defaults, their schema, and the options objects built from them."""

from __future__ import annotations

import dataclasses
import json
import pathlib

import dask
import pytest
import yaml
from dask.utils import parse_bytes, parse_timedelta

import dask_overlap
from dask_overlap import Options, TimedModel

jsonschema = pytest.importorskip("jsonschema")  # a test extra; the GPU machine lacks it

PACKAGE = pathlib.Path(dask_overlap.__file__).parent


@pytest.fixture(scope="module")
def defaults() -> dict:
    return yaml.safe_load((PACKAGE / "overlap.yaml").read_text())


@pytest.fixture(scope="module")
def schema() -> dict:
    return json.loads((PACKAGE / "overlap.schema.json").read_text())


# -- the YAML and the schema in step ----------------------------------------------------
def test_defaults_validate_against_the_schema(defaults, schema):
    jsonschema.Draft7Validator.check_schema(schema)
    jsonschema.validate(defaults, schema)


def _walk(config: dict, schema: dict, path: str = "") -> list[str]:
    """Differences between the keys of ``config`` and the properties of ``schema``."""
    problems = []
    props = schema.get("properties", {})
    for key in config.keys() - props.keys():
        problems.append(f"{path}{key} is in the YAML but not in the schema")
    for key in props.keys() - config.keys():
        problems.append(f"{path}{key} is in the schema but not in the YAML")
    for key in config.keys() & props.keys():
        sub = props[key]
        is_object = sub.get("type") == "object" or "properties" in sub
        if isinstance(config[key], dict) != is_object:
            problems.append(f"{path}{key}: the YAML and the schema disagree on nesting")
        elif is_object:
            problems += _walk(config[key], sub, f"{path}{key}.")
            if sub.get("additionalProperties") is not False:
                problems.append(f"{path}{key}: the schema allows keys it does not list")
    return problems


def test_every_key_in_the_yaml_is_in_the_schema_and_vice_versa(defaults, schema):
    assert _walk(defaults, schema) == []


def test_the_key_check_sees_a_difference(defaults, schema):
    """The comparison above can fail: a key missing on either side is reported."""
    extra = {"overlap": dict(defaults["overlap"], surprise=1)}
    assert _walk(extra, schema) == ["overlap.surprise is in the YAML but not in the schema"]
    fewer = {"overlap": {k: v for k, v in defaults["overlap"].items() if k != "in-flight"}}
    assert _walk(fewer, schema) == ["overlap.in-flight is in the schema but not in the YAML"]
    timed = dict(defaults["overlap"]["timed"])
    timed.pop("kernel-seconds")
    nested = {"overlap": dict(defaults["overlap"], timed=timed)}
    assert _walk(nested, schema) == [
        "overlap.timed.kernel-seconds is in the schema but not in the YAML"
    ]


@pytest.mark.parametrize(
    "key, value",
    [
        ("backend", "gpu"),
        ("in-flight", 0),
        ("in-flight", "4"),
        ("streams", 0),
        ("staging-threads", 1.5),
        ("surprise", 1),
    ],
)
def test_the_schema_rejects_bad_values(defaults, schema, key, value):
    bad = {"overlap": dict(defaults["overlap"], **{key: value})}
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, schema)


def test_issue_keys_are_present(defaults):
    for key in [
        "backend",
        "sub-chunk-bytes",
        "in-flight",
        "streams",
        "staging-threads",
        "pinned-pool-size",
    ]:
        assert key in defaults["overlap"]
    assert defaults["overlap"]["backend"] == "auto"


# -- Options ----------------------------------------------------------------------------
def _as_value(field: str, raw):
    if (field.endswith("bytes") or field.endswith("size")) and raw != "auto":
        return parse_bytes(raw) if isinstance(raw, str) else raw
    if field.endswith("timeout"):
        return parse_timedelta(raw)
    return raw


def test_every_option_is_defaulted_in_the_yaml(defaults):
    opts = Options.from_config()
    for field in dataclasses.fields(Options):
        key = field.name.replace("_", "-")
        assert key in defaults["overlap"], f"{field.name} has no default in overlap.yaml"
        if field.name == "timed":
            continue
        assert getattr(opts, field.name) == _as_value(field.name, defaults["overlap"][key])
    for field in dataclasses.fields(TimedModel):
        key = field.name.replace("_", "-")
        raw = defaults["overlap"]["timed"][key]
        want = float(raw) if field.name == "kernel_seconds" else float(parse_bytes(raw))
        assert getattr(opts.timed, field.name) == want


def test_options_read_dask_config():
    with dask.config.set(
        {
            "overlap.backend": "timed",
            "overlap.sub-chunk-bytes": "1KiB",
            "overlap.in-flight": 7,
            "overlap.streams": 3,
            "overlap.staging-threads": 2,
            "overlap.pinned-pool-size": 0,
            "overlap.timed.h2d-bandwidth": "2MB",
            "overlap.timed.kernel-seconds": 0.5,
        }
    ):
        opts = Options.from_config()
    assert opts.backend == "timed"
    assert opts.sub_chunk_bytes == 1024
    assert opts.in_flight == 7
    assert opts.streams == 3
    assert opts.staging_threads == 2
    assert opts.pinned_pool_size == 0
    assert opts.timed.h2d_bandwidth == 2e6
    assert opts.timed.kernel_seconds == 0.5
    assert opts.timed.kernel_time(2_000_000) == pytest.approx(
        0.5 + 2_000_000 / opts.timed.kernel_bandwidth
    )


def test_keyword_overrides_win_and_none_means_config():
    with dask.config.set({"overlap.in-flight": 7, "overlap.sub-chunk-bytes": "1KiB"}):
        opts = Options.from_config(in_flight=2, sub_chunk_bytes="3KiB", backend="host")
        assert (opts.in_flight, opts.sub_chunk_bytes, opts.backend) == (2, 3072, "host")
        opts = Options.from_config(in_flight=None, sub_chunk_bytes=None)
        assert (opts.in_flight, opts.sub_chunk_bytes) == (7, 1024)
    model = TimedModel.from_config(h2d_bandwidth="5MB")
    assert Options.from_config(timed=model).timed is model
    with dask.config.set({"overlap.timed.d2h-bandwidth": "9MB"}):
        assert TimedModel.from_config(d2h_bandwidth="1MB").d2h_bandwidth == 1e6
        assert TimedModel.from_config().d2h_bandwidth == 9e6


def test_map_blocks_keywords_override_config():
    import dask.array as da
    import numpy as np

    x = da.from_array(np.arange(64.0).reshape(16, 4), chunks=(16, 4))
    with dask.config.set({"overlap.in-flight": 1, "overlap.sub-chunk-bytes": 32}):
        y = dask_overlap.map_blocks(np.negative, x, split_axis=0, in_flight=3)
        np.testing.assert_array_equal(y.compute(), -x.compute())
        stats = dask_overlap.runtime_stats()
    assert stats["sub_chunks"] == 16  # 32 bytes: one row each, from the config
    assert stats["max_window"] == 3  # the keyword, not the config's 1


def test_unknown_option_and_bad_types():
    with pytest.raises(TypeError, match=r"unknown option\(s\) \['inflight'\]"):
        Options.from_config(inflight=3)
    with pytest.raises(TypeError, match="timed must be a TimedModel, got dict"):
        Options.from_config(timed={})
    with pytest.raises(ValueError, match=r"overlap.timed.kernel-seconds .* >= 0, got -1"):
        TimedModel.from_config(kernel_seconds=-1)
    with pytest.raises(ValueError, match=r"overlap.timed.h2d-bandwidth .*got 'fast'"):
        TimedModel.from_config(h2d_bandwidth="fast")
    with pytest.raises(ValueError, match=r"pinned_pool_size must be a number of bytes >= 0"):
        Options.from_config(pinned_pool_size=-1)  # (0 is allowed: no pool)
    for seconds in (float("nan"), float("inf")):  # nan ran as 0, inf overflowed a wait
        with pytest.raises(ValueError, match=r"overlap.timed.kernel-seconds .* >= 0, got"):
            TimedModel.from_config(kernel_seconds=seconds)
    with pytest.raises(ValueError, match=r"overlap.timed.h2d-bandwidth .*got '1e400'"):
        TimedModel.from_config(h2d_bandwidth="1e400")  # an OverflowError, named
    # Longer than a thread's wait may be (every cut partition failed, its gauges left up).
    with pytest.raises(ValueError, match=r"stall_timeout must be a positive duration"):
        Options.from_config(stall_timeout=1e10)


def test_importing_registers_the_defaults(defaults):
    # update_defaults keeps anything a user set; nothing is set in this environment
    for key, value in defaults["overlap"].items():
        if not isinstance(value, dict):
            assert dask.config.get(f"overlap.{key}") == value
