"""The README's Python snippet (its Use section's) runs as written (on the CPU), twice on the same log: the
second run continues after the first one's last epoch, as the snippet's comment says."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from support import PYTHON, REPO, subprocess_env

LOG = "/dev/shm/my-session"


def _snippet() -> str:
    """The python block that opens the README's "## Use" section (the distributed loop's block further down is
    tests/test_distributed.py's)."""
    m = re.search(r"^## Use\n\n```python\n(.*?)^```$", (REPO / "README.md").read_text(), flags=re.S | re.M)
    assert m is not None, "the README's Use section does not open with a python block"
    return m.group(1)


def test_the_readmes_python_snippet_runs_as_written(shm_dir: Path) -> None:
    code = _snippet()
    assert code.count(LOG) >= 2, "the snippet writes and recovers the log the test relocates"
    code = code.replace(LOG, str(shm_dir / "my-session"))  # the only change: a log of this test's own
    epochs = []
    for _ in range(2):
        p = subprocess.run([PYTHON, "-c", code], capture_output=True, text=True, env=subprocess_env(), timeout=300)
        assert p.returncode == 0, p.stdout + p.stderr
        epochs.append(int(re.search(r"CheckpointStats\(epoch=(\d+)", p.stdout).group(1)))  # type: ignore[union-attr]
    assert epochs == [1, 3], epochs  # two epochs per run; the second run continued the first one's log
