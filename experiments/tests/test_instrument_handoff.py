"""CPU CI: a kernel launch paused on an H200 finishes on the CPU. tests/data/h200/paused-rowdot/ is the log the
GPU wrote (tests/data/make_paused_log.py, expected.json says where and with what): the epoch committed while
the launch was paused, its pending blocks recorded by the probes (protocol 4: the control block's done bits;
protocol 5, paused-rowdot-v5/: the per-block skip records), and the output
of the same kernel compiled without probes and run uninterrupted there. A fresh process with no GPU
(TRITON_INTERPRET=1) runs exactly the pending blocks in Triton's interpreter; the output is bit-equal to the
GPU's uninterrupted launch (int32 arithmetic: the interpreter's numpy computes what the GPU does)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("triton")
torch = pytest.importorskip("torch")

from support import subprocess_env  # noqa: E402

TESTS = Path(__file__).resolve().parent
# protocol 4 (done bits in the control block) and protocol 5 (per-block skip records), each written on the H200
LOGS = [p for p in (TESTS / "data" / "h200" / "paused-rowdot", TESTS / "data" / "h200" / "paused-rowdot-v5")
        if p.exists()]

FINISH = textwrap.dedent("""
    import json, os, sys
    os.environ["TRITON_INTERPRET"] = "1"
    import torch
    sys.path.insert(0, {tests!r})
    from concordia_lab.instrument.pause import finish_from_log
    from concordia_ft.runtime import recover
    rec = recover(sys.argv[1])
    before = rec.tensor("paused.arg3", device="cpu").clone()
    t = finish_from_log(sys.argv[1], device="cpu")
    torch.save({{"before": before, "after": t["paused.arg3"]}}, sys.argv[2])
    print("FINISHED", torch.cuda.is_available())
""")


@pytest.mark.parametrize("LOG", LOGS, ids=lambda p: p.name)
def test_a_launch_paused_on_the_gpu_finishes_on_the_cpu_bit_equal(tmp_path: Path, LOG: Path) -> None:  # noqa: N803
    info = json.loads((LOG / "expected.json").read_text())
    assert info["device"] == "cuda" and "H200" in info["gpu"], info  # written on the GPU, not a stand-in
    log = tmp_path / "log"
    shutil.copytree(LOG, log)
    env = subprocess_env()
    env["CUDA_VISIBLE_DEVICES"] = ""  # nothing of the GPU's side is reachable from the finishing process
    r = subprocess.run([sys.executable, "-c", FINISH.format(tests=str(TESTS)), str(log), str(tmp_path / "o.pt")],
                       capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0 and "FINISHED False" in r.stdout, r.stdout + r.stderr[-3000:]
    got = torch.load(tmp_path / "o.pt")
    from concordia_ft.runtime import recover

    rec = recover(log)
    want = rec.tensor("reference.out", device="cpu")
    meta = rec.meta["paused_launch"]
    assert meta["pending"] == info["pending"] > 0 and meta["kernel"] == "rowdot_reps_kernel"
    assert int(meta.get("protocol", 4)) == int(info.get("protocol", 4))
    before, after = got["before"], got["after"]
    left = (before != want).nonzero().flatten().tolist()
    assert left and min(left) >= info["long_rows"]  # the GPU left short rows; the long ones it finished
    assert torch.equal(after, want)  # every row: the GPU's blocks kept, the CPU's bit-equal to the GPU's
    # and independently of both: the pending rows recomputed here with numpy, int32 wrap-around
    x = rec.tensor("paused.arg0", device="cpu").numpy().astype(np.int64)
    w = rec.tensor("paused.arg1", device="cpu").numpy().astype(np.int64)
    reps = rec.tensor("paused.arg2", device="cpu").numpy()
    for row in left:
        acc = np.zeros(x.shape[1], dtype=np.int64)
        for _ in range(int(reps[row])):
            acc = (acc * 3 + x[row] * w) % (1 << 32)
        val = int(acc.sum() % (1 << 32))
        assert int(after[row]) == (val - (1 << 32) if val >= 1 << 31 else val), row
