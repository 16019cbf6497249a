"""A real browser opens ``/overlap`` during a run: the timeline must render with data.

Headless Chromium (Debian's ``chromium``; ``ci/test.sh`` installs it when it runs as
root) is driven over the DevTools protocol with tornado's websocket client: navigate,
wait until the page's ``overlap-timeline`` data source holds spans and its figures are
drawn, then save a screenshot.
"""

from __future__ import annotations

import asyncio
import base64
import itertools
import json
import os
import shutil
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import dask.array as da
import numpy as np
import pytest
from distributed import Client, LocalCluster

import dask_overlap

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = pytest.mark.skipif(
    CHROMIUM is None,
    reason="needs Debian's chromium (ci/test.sh installs it when run as root: "
    "apt-get install -y chromium)",
)

FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
    "--window-size=1400,1100",
]

# Spans the page's timeline source holds, and the figures (canvases) drawn; -1: no
# Bokeh document yet.
PROBE = """(() => {
  const d = window.Bokeh && Bokeh.documents && Bokeh.documents[0];
  if (!d) return {spans: -1, canvases: 0};
  const s = d.get_model_by_name("overlap-timeline");
  let canvases = 0;
  const walk = (root) => {
    for (const el of root.querySelectorAll("*")) {
      if (el.tagName === "CANVAS") canvases += 1;
      if (el.shadowRoot) walk(el.shadowRoot);
    }
  };
  walk(document);
  return {spans: s ? s.data.left.length : -2, canvases: canvases};
})()"""


def slow(b: np.ndarray) -> np.ndarray:
    time.sleep(0.05)  # keeps the run going while the browser loads the page
    return b * 2 + 1


class DevTools:
    """The few DevTools-protocol calls this test needs, over one page's websocket."""

    def __init__(self, ws: Any):
        self.ws = ws
        self.ids = itertools.count(1)

    @classmethod
    async def connect(cls, port: int) -> DevTools:
        from tornado.websocket import websocket_connect

        with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=10) as r:
            pages = [t for t in json.load(r) if t["type"] == "page"]
        ws = await websocket_connect(pages[0]["webSocketDebuggerUrl"], max_message_size=1 << 28)
        return cls(ws)

    async def call(self, method: str, **params: Any) -> dict[str, Any]:
        i = next(self.ids)
        await self.ws.write_message(json.dumps({"id": i, "method": method, "params": params}))
        while True:
            msg = await asyncio.wait_for(self.ws.read_message(), timeout=30)
            if msg is None:
                raise ConnectionError("the browser closed the DevTools connection")
            reply = json.loads(msg)
            if reply.get("id") == i:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply["result"]

    async def evaluate(self, expression: str) -> Any:
        out = await self.call("Runtime.evaluate", expression=expression, returnByValue=True)
        return out["result"].get("value")


@pytest.fixture
def chromium(tmp_path: Path) -> Iterator[int]:
    """A headless Chromium; yields its DevTools port."""
    profile = tmp_path / "profile"
    proc = subprocess.Popen(
        [CHROMIUM, *FLAGS, "--remote-debugging-port=0", f"--user-data-dir={profile}"]
        + ["about:blank"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        port_file = profile / "DevToolsActivePort"
        deadline = time.monotonic() + 60
        while not (port_file.exists() and port_file.read_text().strip()):
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"chromium did not start (exit code {proc.poll()})")
            time.sleep(0.1)
        yield int(port_file.read_text().split()[0])
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


async def _open_and_capture(port: int, url: str, shot: Path) -> dict[str, Any]:
    tools = await DevTools.connect(port)
    try:
        await tools.call("Page.enable")
        await tools.call("Page.navigate", url=url)
        deadline = time.monotonic() + 90
        seen: dict[str, Any] = {}
        while time.monotonic() < deadline:
            seen = await tools.evaluate(PROBE) or {}
            if seen.get("spans", 0) > 0 and seen.get("canvases", 0) > 0:
                break
            await asyncio.sleep(0.25)
        await asyncio.sleep(0.5)  # one more paint of what the source holds
        png = await tools.call("Page.captureScreenshot", format="png")
        shot.write_bytes(base64.b64decode(png["data"]))
        return seen
    finally:
        tools.ws.close()


def test_overlap_page_renders_the_timeline_during_a_run(chromium: int, tmp_path: Path) -> None:
    with (
        LocalCluster(
            n_workers=2,
            threads_per_worker=2,
            processes=True,
            dashboard_address="127.0.0.1:0",
            worker_dashboard_address=None,
        ) as cluster,
        Client(cluster) as client,
    ):
        dask_overlap.register(
            client, backend="host", pinned_pool_size="64MiB", in_flight=2, streams=2
        )
        x = da.ones((40_000, 512), chunks=(250, 512))
        y = dask_overlap.map_blocks(slow, x, split_axis=0, sub_chunk_bytes="64KiB")
        futures = client.compute(y.to_delayed().ravel().tolist())
        try:
            url = f"http://127.0.0.1:{cluster.scheduler.http_server.port}/overlap"
            shot = tmp_path / "overlap.png"
            seen = asyncio.run(_open_and_capture(chromium, url, shot))
            running = sum(f.status == "pending" for f in futures)
        finally:
            client.cancel(futures)
    out = os.environ.get("DASK_OVERLAP_SCREENSHOT")
    if out:  # keep the picture (CI artefact)
        shutil.copy(shot, out)
    assert seen.get("spans", 0) > 0, f"the page's timeline source stayed empty: {seen}"
    assert seen.get("canvases", 0) > 0, f"no figure was drawn: {seen}"
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert shot.stat().st_size > 10_000  # a drawn page, not a blank one
    assert running > 0, "the run ended before the page was checked; make it longer"
