"""A picture of the ``/overlap`` dashboard page from a saved ``/overlap.json``.

Two steps, which may run on different machines (the GPU machine need not have a browser):

1. ``capture``: run a job on a :class:`~dask_overlap.LocalGPUCluster` (one worker per
   GPU) and save ``/overlap.json?detail=1`` while it runs::

       python benchmarks/diagnostics/dashboard_snapshot.py capture overlap.json

   ``?detail=1`` asks each worker once for every span of its last ten seconds (at most
   the newest 1500); plain ``/overlap.json`` holds what the workers' heartbeats brought
   while it was read, a sample of the newest spans each heartbeat. Or fetch it yourself
   from any cluster's dashboard: ``curl 'http://SCHEDULER:8787/overlap.json?detail=1'``.

2. ``render``: draw the page from that file as a standalone HTML file (Bokeh inlined) and,
   where Debian's ``chromium`` is installed, a PNG screenshot of it::

       python benchmarks/diagnostics/dashboard_snapshot.py render overlap.json \\
           --html benchmarks/results/overlap_dashboard.html \\
           --png benchmarks/results/overlap_dashboard.png
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path


def capture(out: Path, gib: float, chunk_mib: int, delay: float) -> None:
    """Run ``2 * x + 1`` over ``gib`` GiB and save ``/overlap.json?detail=1`` ``delay`` s in."""
    import dask.array as da
    from distributed import Client, wait

    import dask_overlap
    from dask_overlap import LocalGPUCluster

    rows = int(gib * 2**30) // (1024 * 4)
    chunk_rows = chunk_mib * 2**20 // (1024 * 4)
    with (
        LocalGPUCluster(allow_cpu=True, dashboard_address="127.0.0.1:0") as cluster,
        Client(cluster),
    ):
        x = da.random.random((rows, 1024), chunks=(chunk_rows, 1024)).astype("float32")
        x = x.persist()
        wait(x)
        port = cluster.scheduler.http_server.port
        url = f"http://127.0.0.1:{port}/overlap.json?detail=1"
        saved: dict[str, bytes] = {}

        def grab() -> None:
            time.sleep(delay)
            with urllib.request.urlopen(url, timeout=30) as r:
                saved["json"] = r.read()

        t = threading.Thread(target=grab)
        t.start()
        y = dask_overlap.map_blocks(lambda b: b * 2 + 1, x, split_axis=0).persist()
        wait(y)
        t.join()
        if "json" not in saved:
            sys.exit("could not fetch /overlap.json")
        out.write_bytes(saved["json"])
        snap = json.loads(saved["json"])
        spans = sum(len(w["timeline"]["start"]) for w in snap["workers"].values())
        print(f"saved {out}: {len(snap['workers'])} worker(s), {spans} spans")


def render(src: Path, html: Path, png: Path | None) -> None:
    """Render ``src`` (a saved ``/overlap.json``) to ``html``, and to ``png`` if asked."""
    from dask_overlap.dashboard import render_html

    snap = json.loads(src.read_text())
    html.parent.mkdir(parents=True, exist_ok=True)
    render_html(snap, str(html))
    print(f"wrote {html}")
    if png is None:
        return
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        sys.exit("no chromium here (apt-get install -y chromium); open the HTML instead")
    height = 160  # as the page lays out: a timeline row per stream, then the throughput
    for w in snap["workers"].values():
        lanes = max([int(w.get("streams", 0)), *(j + 1 for j in w["timeline"]["stream"])])
        height += max(200, 70 + 15 * (lanes + 1)) + 280
    with tempfile.TemporaryDirectory() as profile:
        subprocess.run(
            [
                chromium,
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--no-first-run",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
                f"--user-data-dir={profile}",
                "--hide-scrollbars",
                "--virtual-time-budget=5000",
                f"--window-size=1400,{height}",
                f"--screenshot={os.path.abspath(png)}",
                html.resolve().as_uri(),
            ],
            check=True,
            capture_output=True,
            timeout=120,
        )
    print(f"wrote {png}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    cap = sub.add_parser("capture", help="run a job and save /overlap.json mid-run")
    cap.add_argument("out", type=Path)
    cap.add_argument("--gib", type=float, default=8.0, help="input size [8]")
    cap.add_argument("--chunk-mib", type=int, default=256, help="partition size [256]")
    cap.add_argument("--delay", type=float, default=1.0, help="seconds into the run [1]")
    ren = sub.add_parser("render", help="draw the page from a saved /overlap.json")
    ren.add_argument("src", type=Path)
    ren.add_argument("--html", type=Path, default=Path("benchmarks/results/overlap_dashboard.html"))
    ren.add_argument("--png", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.command == "capture":
        capture(args.out, args.gib, args.chunk_mib, args.delay)
    else:
        render(args.src, args.html, args.png)


if __name__ == "__main__":
    main()
