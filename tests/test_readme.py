"""The README's Python code runs as written (#14): each ```python block as a script of its
own, in a fresh process, as a newcomer would paste it (in CI: on the CPU path). Exit
status 0 is not enough: a process-based cluster without a ``__main__`` guard prints its
workers' tracebacks and still exits 0."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
from support import without_shutdown_noise

README = os.path.join(os.path.dirname(__file__), os.pardir, "README.md")


def blocks() -> list[str]:
    with open(README) as f:
        return re.findall(r"^```python\n(.*?)^```", f.read(), flags=re.M | re.S)


def test_the_readme_has_python_to_run():
    assert blocks()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("index", range(len(blocks())))
def test_readme_code_runs_as_written(index, tmp_path):
    script = tmp_path / f"readme_{index}.py"
    script.write_text(blocks()[index])
    root = os.path.abspath(os.path.join(os.path.dirname(README)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
        timeout=280,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    stderr = without_shutdown_noise(done.stderr)
    assert "Traceback" not in stderr, stderr[-3000:]
    if "equal:" in done.stdout:
        assert "equal: True" in done.stdout, done.stdout
