"""``benchmarks/diagnostics/chained_stages.py`` runs on the CPU path: both chains right,
and the auto chain runs one cut (the second stage's), not two, as it does where a device
runs the partitions (``as_on_a_device``: on the host backend alone ``auto`` joins
nothing, so nothing is cut back). No figure is asserted on."""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "benchmarks", "diagnostics"))
import chained_stages  # noqa: E402


def test_chained_stages_on_the_cpu(tmp_path, as_on_a_device):
    path = tmp_path / "chain.json"
    out = chained_stages.main(
        ["--size", "8MiB", "--block", "64KiB", "--threads", "2", "--repeat", "1",
         "--batch", "4", "--json", str(path)]
    )  # fmt: skip
    assert json.loads(path.read_text()) == json.loads(json.dumps(out))
    assert out["blocks"] == 128
    auto, kept = out["runs"]["auto"], out["runs"]["4"]
    assert auto["correct"] and kept["correct"]
    assert auto["tasks"]["overlap-unbatch"] == 128  # the second stage's cut only
    assert "overlap-unbatch" not in kept["tasks"]
