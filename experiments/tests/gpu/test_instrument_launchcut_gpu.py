"""GPU: epoch cuts between SASS-only launches, placed by the interposer's launch callback in an eager PyTorch
loop that keeps the GPU queue full, while another thread asks for them. Each cut is requested for a definite
launch ahead of the program (``at_launch``: the first launch of a step AHEAD steps later), so where it lands
does not depend on either thread's timing: the loop only waits, at the step it gives the cutter, until that cut
is armed (else a slow cutter could ask for a launch already issued), and then runs AHEAD more steps freely.
Every epoch a fresh reader recovers must be the device state exactly at that launch: not torn, equal to the
state after the steps enqueued before it (an int32 add: the count itself; cuBLAS: the state replayed
afterwards, bit for bit), and the cut's launch number and crossing kernel must be the requested ones."""

from __future__ import annotations

import functools
import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

from concordia_lab.instrument import interposer as ip

APP = textwrap.dedent("""
    import json, sys, tempfile, threading
    import numpy as np, torch
    import concordia_ft as cft
    from concordia_lab.instrument.launchcut import SassBoundary
    torch.backends.cuda.matmul.allow_tf32 = False
    AHEAD = 50

    def case(name):
        rt = cft.Runtime(tempfile.mkdtemp(dir="/dev/shm"), fsync="never", backend="dram")
        if name == "add":
            x = torch.zeros(1 << 24, dtype=torch.int32, device="cuda")
            step = lambda i: x.add_(1)
            region, n = x, 20000
        else:
            g = torch.Generator().manual_seed(1)
            x0 = torch.randn(1024, 1024, generator=g)
            # orthogonal: the state keeps its size over thousands of GEMMs (no overflow to inf/NaN, which
            # would make bit-equality meaningless), while every GEMM still rounds
            w = torch.linalg.qr(torch.randn(1024, 1024, generator=g, dtype=torch.float64))[0].float().cuda()
            bufs = [x0.cuda(), torch.empty(1024, 1024, device="cuda")]
            step = lambda i: torch.matmul(bufs[i % 2], w, out=bufs[(i + 1) % 2])
            region, n = bufs[0], 4000
        sb = SassBoundary(rt, {"x": region})
        for i in range(4):
            step(i)
        torch.cuda.synchronize()
        s0 = sb.cut.launch_seq()
        for i in range(4, 8):
            step(i)
        torch.cuda.synchronize()
        per = (sb.cut.launch_seq() - s0) // 4  # launches per step (cuBLAS: its GEMM kernel(s))
        gates = [4 + n * (2 * j + 1) // 10 for j in range(4)]  # steps at which the loop hands a launch number over
        handed = {k: (threading.Event(), threading.Event(), {}) for k in gates}  # (at gate, armed, launch seq)
        got, errors = [], []

        def cutter():
            try:
                for k in gates:
                    at, armed, box = handed[k]
                    assert at.wait(120), f"the loop never reached step {k}"
                    target = box["seq"] + 1 + AHEAD * per  # the first launch of step k + AHEAD
                    sb.request(at_launch=target)
                    armed.set()
                    e = sb.commit(timeout_s=30.0)
                    rec = cft.recover(rt.log_dir)
                    assert rec.epoch == e, (rec.epoch, e)
                    got.append({"step": k + AHEAD, "target": target, "launch": sb.last.launch,
                                "after": sb.last.kernel_after, "raw": np.array(rec.regions["x"], copy=True)})
            except BaseException as ex:  # reported, and the loop is let go
                errors.append(repr(ex))
                for _, armed, _ in handed.values():
                    armed.set()

        th = threading.Thread(target=cutter)
        th.start()
        start = sb.cut.launch_seq()
        for i in range(8, 8 + n):
            if i in handed:
                at, armed, box = handed[i]
                box["seq"] = sb.cut.launch_seq()
                at.set()
                armed.wait(120)
            step(i)
        torch.cuda.synchronize()
        th.join(120)
        launches = sb.cut.launch_seq() - start
        out = []
        if name == "add":
            for c in got:
                vals = np.unique(c.pop("raw").view(np.int32))
                out.append({**c, "values": vals[:3].tolist(), "expect": c["step"]})
        else:
            s, t = x0.cuda(), torch.empty(1024, 1024, device="cuda")
            want = {c["step"] - c["step"] % 2: c for c in got}  # bufs[0] holds the state after an even count
            for m in range(max(want, default=-1) + 1):
                if m in want:
                    c = want[m]
                    snap = torch.from_numpy(c.pop("raw").view(np.float32).reshape(1024, 1024).copy()).cuda()
                    c["equal"] = bool(torch.equal(snap, s))
                    c["finite"] = bool(torch.isfinite(s).all())
                    c["max_abs_diff"] = float((snap - s).abs().max())
                    c["expect"] = m
                torch.matmul(s, w, out=t)  # s: the state after m GEMMs
                s, t = t, s
            out = [{k: v for k, v in c.items() if k != "raw"} for c in got]
        return {"launches": launches, "n": n, "per_step": per, "cuts": out, "errors": errors}

    print(json.dumps({name: case(name) for name in sys.argv[1:]}))
""")


@functools.lru_cache(maxsize=1)
def run_both() -> dict[str, Any]:
    """One process for both loops (one torch start-up)."""
    env = ip.child_env()
    env["PYTHONPATH"] = f"{Path(ip.__file__).resolve().parents[2]}:{env.get('PYTHONPATH', '')}"
    r = subprocess.run([sys.executable, "-c", APP, "add", "gemm"], capture_output=True, text=True, timeout=300,
                       env=env)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
    assert r.returncode == 0 and lines, r.stdout + r.stderr
    print(lines[-1])
    return dict(json.loads(lines[-1]))


def check_definite(got: dict[str, Any]) -> None:
    assert got["errors"] == [], got["errors"]
    assert len(got["cuts"]) == 4, got
    for c in got["cuts"]:
        assert c["launch"] == c["target"], c  # landed exactly at the launch asked for, not by timing


def test_cuts_between_eager_adds_are_exact_launch_boundaries() -> None:
    got = run_both()["add"]
    assert got["per_step"] == 1 and got["launches"] == got["n"]  # nothing else launched: launches count adds
    check_definite(got)
    for c in got["cuts"]:
        assert c["values"] == [c["expect"]], c  # one value everywhere (not torn), the adds before the cut
        assert "elementwise" in c["after"] or "add" in ip.demangle(c["after"]).lower(), c


def test_cuts_between_cublas_gemms_equal_a_replayed_state() -> None:
    got = run_both()["gemm"]
    assert got["per_step"] >= 1 and got["launches"] == got["n"] * got["per_step"], got
    check_definite(got)
    for c in got["cuts"]:
        assert c["finite"] and c["equal"], c  # bit-equal to the replayed state after exactly those GEMMs
