"""Sphinx directives that build parts of the docs from the project itself, never by hand.

- ``overlap-config``: the ``overlap.*`` table, from ``dask_overlap/overlap.schema.json``
  (types, allowed values) and ``dask_overlap/overlap.yaml`` (defaults, and the comment
  above each key as its description).
- ``overlap-runtime-stats``: the keys of :func:`dask_overlap.runtime_stats`, described in
  the directive's content (``key: meaning`` lines) and checked against the keys a runtime
  reports: a key missing from either side is a warning (an error under ``-W``).
- ``overlap-results``: tables of the JSON files in ``benchmarks/results/``, whatever they
  are named, each with its card (``device``) and date. A file written by the benchmarks'
  ``--record`` (``benchmark``, ``date``, ``device``, ``figures``) shows its ``figures``;
  an older plain output shows the headline numbers found in it (GB/s, ratios, µs). Its
  argument names the benchmarks a table shows (``name`` exactly, ``name*`` as a prefix);
  ``:rest:`` shows every file no table before it on the page showed.

Also: every name in ``dask_overlap.__all__`` must be documented somewhere (autodoc), or
the build warns.
"""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
from pathlib import Path
from typing import Any

import yaml
from docutils import nodes
from docutils.parsers.rst import directives
from sphinx.application import Sphinx
from sphinx.util import logging
from sphinx.util.docutils import SphinxDirective

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "dask_overlap"
RESULTS = ROOT / "benchmarks" / "results"  # the default of the ``overlap_results`` setting

logger = logging.getLogger(__name__)


# -- tables ------------------------------------------------------------------------------
Cell = str | nodes.Node


def _cell(value: Cell) -> nodes.entry:
    entry = nodes.entry()
    if isinstance(value, nodes.Node):
        entry += nodes.paragraph("", "", value)
    else:
        entry += nodes.paragraph(text=value)
    return entry


def table(headers: list[str], rows: list[list[Cell]], widths: list[int] | None = None):
    """A docutils table of ``rows`` under ``headers``."""
    group = nodes.tgroup(cols=len(headers))
    for width in widths or [1] * len(headers):
        group += nodes.colspec(colwidth=width)
    head = nodes.thead()
    head += nodes.row("", *(_cell(h) for h in headers))
    body = nodes.tbody()
    for r in rows:
        body += nodes.row("", *(_cell(c) for c in r))
    group += head
    group += body
    return nodes.table("", group)


# -- overlap.* ---------------------------------------------------------------------------
def yaml_comments(text: str) -> dict[str, str]:
    """The comment block above each key of a YAML file, by dotted key."""
    out: dict[str, str] = {}
    stack: list[tuple[int, str]] = []
    comment: list[str] = []
    for line in text.splitlines():
        if not line.strip():
            comment = []
            continue
        m = re.match(r"^(\s*)#\s?(.*)$", line)
        if m:
            comment.append(m.group(2))
            continue
        m = re.match(r"^(\s*)([\w-]+):", line)
        if m:
            indent = len(m.group(1))
            while stack and stack[-1][0] >= indent:
                stack.pop()
            stack.append((indent, m.group(2)))
            out[".".join(k for _, k in stack)] = " ".join(comment)
        comment = []
    return out


def _kind(spec: dict[str, Any]) -> str:
    if "enum" in spec:
        return "one of " + ", ".join(spec["enum"])
    if "oneOf" in spec:
        return " or ".join(_kind(s) for s in spec["oneOf"])
    if "const" in spec:
        return repr(spec["const"])
    kinds = spec.get("type", "")
    text = " or ".join(kinds) if isinstance(kinds, list) else kinds
    if "minimum" in spec:
        text += f", at least {spec['minimum']}"
    return text


class OverlapConfig(SphinxDirective):
    """The ``overlap.*`` configuration table."""

    def run(self) -> list[nodes.Node]:
        schema_path = PACKAGE / "overlap.schema.json"
        yaml_path = PACKAGE / "overlap.yaml"
        for path in (schema_path, yaml_path):
            self.env.note_dependency(str(path))
        schema = json.loads(schema_path.read_text())["properties"]["overlap"]["properties"]
        text = yaml_path.read_text()
        defaults = yaml.safe_load(text)["overlap"]
        comments = yaml_comments(text)
        rows: list[list[Cell]] = []

        def add(key: str, spec: dict[str, Any], default: Any) -> None:
            about = comments.get(f"overlap.{key}") or spec.get("description", "")
            shown = "" if isinstance(default, dict) else str(default)
            rows.append([nodes.literal(text=f"overlap.{key}"), shown, _kind(spec), about])

        for key in sorted(set(schema) ^ set(defaults)):
            logger.warning(f"overlap.{key} is in only one of overlap.yaml and its schema")
        for key, spec in schema.items():
            if key not in defaults:
                continue
            add(key, spec, defaults[key])
            for sub, sub_spec in spec.get("properties", {}).items():
                add(f"{key}.{sub}", sub_spec, defaults[key].get(sub))
        return [table(["key", "default", "type", "what it sets"], rows, [18, 8, 12, 62])]


# -- runtime_stats() ---------------------------------------------------------------------
def live_stats_keys() -> set[str]:
    """The keys a host runtime reports (made here, and closed again)."""
    import dask_overlap

    try:
        return set(dask_overlap.get_runtime("host").stats())
    finally:
        dask_overlap.close_runtimes()


class RuntimeStats(SphinxDirective):
    """The keys of ``runtime_stats()``: ``key: meaning`` lines, checked against a runtime."""

    has_content = True

    def run(self) -> list[nodes.Node]:
        described: dict[str, list[str]] = {}
        key = None
        for line in self.content:
            m = re.match(r"^([a-z_0-9]+):\s*(.*)$", line)
            if m:
                key = m.group(1)
                described[key] = [m.group(2)]
            elif key and line.strip():
                described[key].append(line.strip())
        live = live_stats_keys()
        for missing in sorted(live - set(described)):
            logger.warning(
                f"runtime_stats() key {missing!r} is not described", location=self.get_location()
            )
        for stale in sorted(set(described) - live):
            logger.warning(
                f"{stale!r} is described but runtime_stats() has no such key",
                location=self.get_location(),
            )
        rows: list[list[Cell]] = []
        for k, v in described.items():
            inline, messages = self.state.inline_text(" ".join(v), self.lineno)
            meaning = nodes.inline("", "", *inline)
            rows.append([nodes.literal(text=k), meaning])
            if messages:
                logger.warning(
                    f"runtime_stats() key {k!r}: bad markup", location=self.get_location()
                )
        return [table(["key", "meaning"], rows, [25, 75])]


# -- benchmarks/results ------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Result:
    """One results file: its benchmark's name, where and when it ran, its figures."""

    path: Path
    name: str
    card: str
    date: str
    commit: str | None
    figures: dict[str, Any]


_HEADLINE = re.compile(r"gbps|_over_|(^|_)ratio($|_)|speedup|us_per_partition|^correct$|^equal$")
_SHAPE = ("size_bytes", "partition_bytes", "workers", "threads", "threads_per_worker")


def _scalars(d: dict[str, Any]) -> dict[str, Any]:
    """The headline numbers of a plain output: GB/s (``gbps`` dicts too), ratios, µs, and
    the shape of the run."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict) and k == "gbps":
            out.update({f"{kk} GB/s": vv for kk, vv in v.items() if _number(vv)})
        elif (_number(v) or isinstance(v, bool)) and (_HEADLINE.search(k) or k in _SHAPE):
            out[k] = v
    return out


def _number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def headline(raw: Any) -> dict[str, Any]:
    """Figures of a plain benchmark output (one written before ``--record``)."""
    if isinstance(raw, list):
        rows = {}
        for i, r in enumerate(x for x in raw if isinstance(x, dict)):
            label = (
                f"threads={r['threads_per_worker']}" if "threads_per_worker" in r else f"#{i + 1}"
            )
            rows[label] = _scalars(r)
        return {k: v for k, v in rows.items() if v}
    if not isinstance(raw, dict):
        return {}
    cases = {k: _scalars(v) for k, v in raw.items() if isinstance(v, dict) and k != "gbps"}
    out: dict[str, Any] = _scalars(raw)
    out.update({k: v for k, v in cases.items() if len(v) > 1})
    return out


def _git_date(path: Path) -> str | None:
    try:
        done = subprocess.run(
            ["git", "log", "-1", "--format=%cs", "--", str(path)],
            cwd=ROOT, capture_output=True, text=True, timeout=30, check=False,
        )  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() or None


def _card(data: Any, stem: str) -> str:
    first = data[0] if isinstance(data, list) and data else data
    if isinstance(first, dict):
        for key in ("device", "gpu"):
            if isinstance(first.get(key), str):
                return first[key]
        if first.get("backend") in ("host", "timed"):
            return f"a CPU (the {first['backend']} backend)"
    m = re.search(r"(?:^|-)([ahlbv]\d{2,3})(?:-|$)", stem)
    return f"NVIDIA {m.group(1).upper()} (from the file's name)" if m else "not recorded"


def load_result(path: Path) -> Result | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        logger.warning(f"benchmarks/results/{path.name} cannot be read: {e}")
        return None
    record = isinstance(data, dict) and {"benchmark", "figures"} <= set(data)
    raw = data.get("result", data) if record else data
    date = (data.get("date") if isinstance(data, dict) else None) or _git_date(path)
    return Result(
        path=path,
        name=data["benchmark"] if record else path.stem,
        card=_card(data if record else raw, path.stem),
        date=str(date or "not recorded"),
        commit=data.get("commit") if record else None,
        figures=data["figures"] if record and isinstance(data["figures"], dict) else headline(raw),
    )


def history_counts(results: Path) -> dict[str, int]:
    """Runs per benchmark in ``history.jsonl`` (empty where there is none)."""
    counts: dict[str, int] = {}
    path = results / "history.jsonl"
    if path.exists():
        for line in path.read_text().splitlines():
            if line.strip():
                name = json.loads(line).get("benchmark", "?")
                counts[name] = counts.get(name, 0) + 1
    return counts


def _header(key: str) -> str:
    for old, new in (
        ("_gbps", " GB/s"),
        ("_over_", " / "),
        ("_us_per_partition", " µs a partition"),
    ):
        key = key.replace(old, new)
    return key.replace("_", " ").replace("dask overlap", "dask_overlap")


def _value(key: str, v: Any) -> str:
    from dask.utils import format_bytes

    if isinstance(v, bool):
        return "yes" if v else "no"
    if not _number(v):
        return str(v)
    if key.endswith("_bytes") and "_over_" not in key:
        return format_bytes(int(v))
    if "gbps" in key or "GB/s" in key or re.fullmatch(r"split_axis=.*", key):
        return f"{v:.2f}"
    if "us_per" in key:
        return f"{v:.0f}"
    return f"{v:.3g}" if isinstance(v, float) else str(v)


def figures_nodes(figures: dict[str, Any]) -> list[nodes.Node]:
    """A paragraph of the scalar figures, and a table per level of cases."""
    out: list[nodes.Node] = []
    top = {k: v for k, v in figures.items() if not isinstance(v, dict)}
    if top:
        out.append(
            nodes.paragraph(text="; ".join(f"{_header(k)}: {_value(k, v)}" for k, v in top.items()))
        )
    cases = {k: v for k, v in figures.items() if isinstance(v, dict)}
    flat = {k: v for k, v in cases.items() if not any(isinstance(x, dict) for x in v.values())}
    if flat:
        columns = list(dict.fromkeys(c for v in flat.values() for c in v))
        rows: list[list[Cell]] = [
            [case, *(_value(c, v[c]) if c in v else "" for c in columns)]
            for case, v in flat.items()
        ]
        out.append(table(["", *(_header(c) for c in columns)], rows))
    for k, v in cases.items():
        if k not in flat:
            out.append(nodes.paragraph("", "", nodes.emphasis(text=_header(k))))
            out.extend(figures_nodes(v))
    return out


def _matches(result: Result, patterns: list[str]) -> bool:
    names = {result.name, result.path.stem}
    return any(
        any(n.startswith(p[:-1]) for n in names) if p.endswith("*") else p in names
        for p in patterns
    )


class OverlapResults(SphinxDirective):
    """Tables of the results files of the benchmarks named (``:rest:``: all not shown yet)."""

    optional_arguments = 1
    final_argument_whitespace = True
    option_spec = {"rest": directives.flag}

    def run(self) -> list[nodes.Node]:
        shown: set[Path] = self.env.temp_data.setdefault("overlap_results_shown", set())
        results_dir = Path(self.config.overlap_results)
        paths = sorted(results_dir.glob("*.json"))
        for path in paths:
            self.env.note_dependency(str(path))
        results = [r for r in map(load_result, paths) if r is not None]
        if "rest" in self.options:
            chosen = [r for r in results if r.path not in shown]
        else:
            patterns = (self.arguments[0] if self.arguments else "").split()
            chosen = [r for r in results if _matches(r, patterns)]
        if not chosen:
            none = "other results file" if "rest" in self.options else "results file of this one"
            return [nodes.paragraph(text=f"(No {none} in benchmarks/results/.)")]
        counts = history_counts(results_dir)
        out: list[nodes.Node] = []
        for r in sorted(chosen, key=lambda r: (r.date, r.path.name), reverse=True):
            shown.add(r.path)
            where = f"{r.card}, {r.date}" + (f", commit {r.commit}" if r.commit else "")
            runs = counts.get(r.name, 0)
            older = f" ({runs} run(s) of {r.name} in history.jsonl)" if runs else ""
            head = nodes.paragraph()
            head += nodes.literal(text=f"benchmarks/results/{r.path.name}")
            head += nodes.Text(f": {where}{older}")
            out.append(head)
            out.extend(figures_nodes(r.figures) or [nodes.paragraph(text="(no headline figures)")])
        return out


# -- every public name documented --------------------------------------------------------
def check_public_names(app: Sphinx, env: Any) -> None:
    import dask_overlap

    documented = {name for name, *_ in env.get_domain("py").get_objects()}
    for name in dask_overlap.__all__:
        if f"dask_overlap.{name}" not in documented:
            logger.warning(f"dask_overlap.{name} (in __all__) is not documented")


def setup(app: Sphinx) -> dict[str, Any]:
    # Where the performance page's results files are (sphinx-build -D overlap_results=DIR).
    app.add_config_value("overlap_results", str(RESULTS), "env")
    app.add_directive("overlap-config", OverlapConfig)
    app.add_directive("overlap-runtime-stats", RuntimeStats)
    app.add_directive("overlap-results", OverlapResults)
    app.connect("env-check-consistency", check_public_names)
    return {"version": "1", "parallel_read_safe": True, "parallel_write_safe": True}
