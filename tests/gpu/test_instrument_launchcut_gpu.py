"""GPU: epoch cuts between SASS-only launches, placed by the interposer's launch callback in an eager PyTorch
loop that keeps the GPU queue full, while another thread asks for them. Every epoch a fresh reader recovers
must be the device state at one launch boundary: not torn, and exactly the state after the launches enqueued
before the one that crossed the cut (an int32 add: the count itself; cuBLAS: a state replayed afterwards)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

from concordia_ft.instrument import interposer as ip

APP = textwrap.dedent("""
    import json, sys, tempfile, threading, time
    import numpy as np, torch
    import concordia_ft as cft
    from concordia_ft.instrument import interposer as ip
    from concordia_ft.instrument.launchcut import SassBoundary, LaunchCut
    torch.backends.cuda.matmul.allow_tf32 = False
    case = sys.argv[1]
    rt = cft.Runtime(tempfile.mkdtemp(dir="/dev/shm"), fsync="never", backend="dram")
    if case == "add":
        x = torch.zeros(1 << 24, dtype=torch.int32, device="cuda")
        step = lambda i: x.add_(1)
        region, n = x, 20000
    else:
        g = torch.Generator().manual_seed(1)
        x0 = torch.randn(1024, 1024, generator=g)
        w = ((torch.eye(1024) + 0.01 * torch.randn(1024, 1024, generator=g)) / 1.0005).cuda()
        bufs = [x0.cuda(), torch.empty(1024, 1024, device="cuda")]
        step = lambda i: torch.matmul(bufs[i % 2], w, out=bufs[(i + 1) % 2])
        region, n = bufs[0], 4000
    sb = SassBoundary(rt, {"x": region})
    for i in range(4):
        step(i)
    torch.cuda.synchronize()
    cut = LaunchCut()
    import ctypes
    buf = ctypes.create_string_buffer(512); cut.lib.cft_cut_info(buf, 512); start = json.loads(buf.value)["launch_seq"]
    got = []
    def cutter():
        for _ in range(4):
            time.sleep(0.02)
            e = sb.checkpoint(timeout_s=5.0)
            rec = cft.recover(rt.log_dir)
            assert rec.epoch == e
            got.append((sb.last.launch - start, sb.last.kernel_after, np.array(rec.regions["x"], copy=True)))
    th = threading.Thread(target=cutter); th.start()
    for i in range(4, 4 + n):
        step(i)
    torch.cuda.synchronize(); th.join()
    cut.lib.cft_cut_info(buf, 512); launches = json.loads(buf.value)["launch_seq"] - start
    out = []
    if case == "add":
        for k, name, raw in got:
            vals = np.unique(raw.view(np.int32))
            out.append({"values": vals[:3].tolist(), "expect": 4 + k - 1, "after": name})
    else:
        snaps = [torch.from_numpy(raw.view(np.float32).reshape(1024, 1024).copy()).cuda() for _, _, raw in got]
        s, t = x0.cuda(), torch.empty(1024, 1024, device="cuda")
        hits = [[] for _ in got]
        for k in range(4 + n + 1):
            if k % 2 == 0:
                for j, sn in enumerate(snaps):
                    if torch.equal(sn, s):
                        hits[j].append(k)
            torch.matmul(s, w, out=t); s, t = t, s
        for (k, name, _), h in zip(got, hits):
            before = 4 + k - 1
            out.append({"states": h[:3], "expect": before - before % 2, "after": name})
    print(json.dumps({"launches": launches, "n": n, "cuts": out}))
""")


def run(case: str) -> dict:  # type: ignore[type-arg]
    env = ip.child_env()
    env["PYTHONPATH"] = f"{Path(ip.__file__).resolve().parents[2]}:{env.get('PYTHONPATH', '')}"
    r = subprocess.run([sys.executable, "-c", APP, case], capture_output=True, text=True, timeout=300, env=env)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
    assert r.returncode == 0 and lines, r.stdout + r.stderr
    return dict(json.loads(lines[-1]))


def test_cuts_between_eager_adds_are_exact_launch_boundaries() -> None:
    got = run("add")
    assert got["launches"] == got["n"]  # nothing else launched: launch numbers count the adds
    assert len(got["cuts"]) == 4
    for c in got["cuts"]:
        assert c["values"] == [c["expect"]], c  # one value everywhere (not torn), the adds before the cut
        assert "elementwise" in c["after"] or "add" in ip.demangle(c["after"]).lower(), c


def test_cuts_between_cublas_gemms_equal_a_replayed_state() -> None:
    got = run("gemm")
    assert len(got["cuts"]) == 4
    for c in got["cuts"]:
        assert c["states"], c  # bit-equal to a state of the uninterrupted sequence
        if got["launches"] == got["n"]:  # one launch per matmul: the launch number names the state
            assert c["expect"] in c["states"], c
