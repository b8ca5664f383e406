"""Write the log of a launch paused on a GPU, for the GPU -> CPU handoff test (tests/test_instrument_handoff.py).

The kernel is ``instrument_kernels.rowdot_reps_kernel`` (int32 arithmetic: the interpreter's numpy computes
exactly what the GPU does). Its first rows are long (DEFAULT_REPS passes each: about a millisecond) and exactly
fill the GPU (one block per resident slot, from the occupancy query), the last NCHEAP rows are short. The pause
lands while the long blocks run, so the short ones are pending: the CPU finishes those in a few
interpreter steps. The epoch holds the paused launch (arguments, control block) and ``reference.out``, the
output of the same kernel compiled without probes and run uninterrupted on that GPU.

    python3 experiments/tests/data/make_paused_log.py --out experiments/tests/data/h200/paused-rowdot

``--device cpu`` writes a stand-in with the interpreter playing the GPU (short rows only; for working on the
test where there is no GPU, never checked in). The LOCK file is not kept.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
NCHEAP = 48
COLS = 16
DEFAULT_REPS = 400_000
NUM_WARPS = 8


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--trials", type=int, default=12)
    ns = ap.parse_args()
    if ns.device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"
    sys.path.insert(0, str(ROOT / "experiments" / "tests"))
    sys.path.insert(0, str(ROOT / "experiments"))
    sys.path.insert(0, str(ROOT / "src"))
    import torch
    import triton

    import instrument_kernels as ik
    from concordia_ft.runtime import Runtime
    from concordia_lab.instrument.safepoints import CTL_BITMAP, ctl_bytes, pending_blocks

    out_dir = Path(ns.out)
    if out_dir.exists() and any(out_dir.iterdir()):
        raise SystemExit(f"{out_dir} is not empty")
    torch.manual_seed(0)
    info: dict[str, object] = {"device": ns.device, "torch": torch.__version__, "triton": triton.__version__,
                               "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    kw = dict(BLOCK=COLS, num_warps=NUM_WARPS)
    if ns.device == "cuda":
        from cuda.bindings import driver as drv

        from concordia_lab.instrument import triton_hook
        from concordia_lab.instrument.pause import PausableLaunch

        info["gpu"] = torch.cuda.get_device_name(0)
        plain = triton.JITFunction(ik.rowdot_reps_kernel.fn)
        probe_x = torch.zeros(1, COLS, dtype=torch.int8, device="cuda")
        probe_args = (probe_x, probe_x[0], torch.ones(1, dtype=torch.int32, device="cuda"),
                      torch.zeros(1, dtype=torch.int32, device="cuda"), COLS, COLS)
        k = plain.warmup(*probe_args, grid=(1,), **kw)  # compiled before the hook: no probes
        k._init_handles()
        _, per_sm = drv.cuOccupancyMaxActiveBlocksPerMultiprocessor(k.function, NUM_WARPS * 32, k.metadata.shared)
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        nlong = int(per_sm) * sms
        reps_long = DEFAULT_REPS
        dev = "cuda"
    else:
        nlong, reps_long, dev = 64, 5, "cpu"
    rows = nlong + NCHEAP
    x = torch.randint(-128, 128, (rows, COLS), dtype=torch.int8, device=dev)
    w = torch.randint(-128, 128, (COLS,), dtype=torch.int8, device=dev)
    reps = torch.full((rows,), 3, dtype=torch.int32, device=dev)
    reps[:nlong] = reps_long
    out = torch.zeros(rows, dtype=torch.int32, device=dev)
    args = [x, w, reps, out, COLS, COLS]
    grid = (rows, 1, 1)
    n = rows
    if ns.device == "cuda":
        ref = torch.zeros_like(out)
        plain[grid](x, w, reps, ref, COLS, COLS, **kw)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        plain[grid](x, w, reps, ref, COLS, COLS, **kw)
        torch.cuda.synchronize()
        info["plain_launch_ms"] = 1e3 * (time.perf_counter() - t0)
        triton_hook.install()  # from here on, compiles get the probes
        inst = triton.JITFunction(ik.rowdot_reps_kernel.fn)
        launch = PausableLaunch(inst, grid, args, kw)
        pend: list[int] = []
        for trial in range(ns.trials):
            out.zero_()
            torch.cuda.synchronize()
            launch.start()
            t_end = time.perf_counter() + 2e-4
            while time.perf_counter() < t_end:
                pass
            launch.pause()
            pend = launch.pending()
            if pend and all(b >= nlong for b in pend):
                info["trial"] = trial
                break
            launch.resume()
            launch.drain()
        else:
            raise SystemExit(f"no trial left only short rows pending (last: {len(pend)} pending)")
        ctl = launch.state()  # protocol 4: the control block with its done bits; 5: the per-block skip records
        protocol = launch.protocol
        info["protocol"] = protocol
        torch.cuda.synchronize()
    else:
        from concordia_lab.instrument.interpret import run_blocks

        ref = torch.zeros_like(out)
        run_blocks(ik.rowdot_reps_kernel, grid, [x, w, reps, ref, COLS, COLS], kw, range(n))
        done = list(range(nlong)) + list(range(nlong, rows, 2))
        run_blocks(ik.rowdot_reps_kernel, grid, args, kw, done)
        ctl = torch.zeros(ctl_bytes(n) // 4, dtype=torch.int32)
        for blk in done:
            ctl[CTL_BITMAP // 4 + blk // 32] |= 1 << (blk % 32)
        pend = pending_blocks(ctl[CTL_BITMAP // 4:].tolist(), n)
        protocol = 4
    info.update(rows=rows, long_rows=nlong, long_reps=reps_long, short_rows=NCHEAP, pending=len(pend),
                pending_first=min(pend), out_nonzero_before_finish=int((out != 0).sum()))
    from concordia_lab.instrument.pause import checkpoint_paused

    rt = Runtime(out_dir, fsync="always")
    rt.register("reference.out", ref.detach().cpu(), kind="dense")
    checkpoint_paused(rt, ik.rowdot_reps_kernel, grid, args, kw, ctl, protocol=protocol)
    rt.close()
    lock = out_dir / "LOCK"
    if lock.exists():
        lock.unlink()
    if ns.device == "cuda":  # and the GPU half of the check: resumed on the GPU, bit-equal
        launch.resume()
        launch.drain()
        info["gpu_resume_bit_equal"] = bool(torch.equal(out, ref)) and not launch.pending()
    (out_dir / "expected.json").write_text(json.dumps(info, indent=1) + "\n")
    print(json.dumps(info))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
