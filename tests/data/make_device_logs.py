"""Write small real logs for the cross-device and old-layout recovery tests (tests/test_session_devices.py,
tests/gpu/test_session_devices_gpu.py): tiny random-weight models whose weights are re-created from a seed
(llm_helpers.tiny_model), so the logs are a few tens of KiB.

- ``session-greedy/``, ``session-sampled/``: a Session generating DEVLOG_NEW tokens after a DEVLOG_PROMPT-token
  prompt, stopped after DEVLOG_KILL_AFTER tokens (on_token raises: the log holds one epoch per token up to
  there, as a killed process leaves it);
- ``lora/`` (``--parts session,lora``): LoRA SFT, DEVLOG_LORA_STEPS sync epochs;
- ``expected.json``: the writer's device and versions, and what the same runs produce uninterrupted there.

tests/data/h200/ was written on an NVIDIA H200 (see expected.json):

    PYTHONPATH=src:tests python3 tests/data/make_device_logs.py --device cuda --out OUTDIR

tests/data/session-v1/ (session metadata version 1, the sampler in region ``rng``) was written on a CPU by the
tree from before the sampler record (commit cecd24d), so it is what that code wrote, not an imitation:

    git archive cecd24d src | tar -x -C OLD && PYTHONPATH=OLD/src:tests python tests/data/make_device_logs.py \\
        --device cpu --out tests/data/session-v1 --parts session

The LOCK file of each log is not kept.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

from llm_helpers import (
    DEVLOG_KILL_AFTER,
    DEVLOG_LORA_STEPS,
    DEVLOG_LORA_TOTAL,
    write_lora,
    write_session,
)


def _keep(src: Path, dst: Path) -> None:
    shutil.rmtree(dst, ignore_errors=True)
    dst.mkdir(parents=True)
    for f in src.iterdir():
        if f.name != "LOCK":
            shutil.copy2(f, dst / f.name)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", required=True)
    ap.add_argument("--parts", default="session,lora")
    a = ap.parse_args()
    import transformers

    out, work = Path(a.out), Path(tempfile.mkdtemp())
    dev = torch.device(a.device)
    expected: dict = {
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "device_type": dev.type, "torch": torch.__version__, "transformers": transformers.__version__,
        "commit": os.environ.get("FIXTURE_COMMIT", ""), "made": datetime.datetime.now(datetime.UTC).isoformat(),
        "session": {}, "lora": None,
    }
    parts = a.parts.split(",")
    if "session" in parts:
        for mode in ("greedy", "sampled"):
            seen = write_session(work / mode, a.device, mode, DEVLOG_KILL_AFTER)
            full = write_session(work / f"{mode}-full", a.device, mode, None)
            assert seen == full[: len(seen)], (seen, full)
            _keep(work / mode, out / f"session-{mode}")
            expected["session"][mode] = {"shown": seen, "uninterrupted": full}
    if "lora" in parts:
        logged = write_lora(work / "lora", a.device, DEVLOG_LORA_STEPS)
        full = write_lora(work / "lora-full", a.device, DEVLOG_LORA_TOTAL)
        assert logged == full[: len(logged)]
        _keep(work / "lora", out / "lora")
        expected["lora"] = {"steps_logged": DEVLOG_LORA_STEPS, "losses": full}
    (out / "expected.json").write_text(json.dumps(expected, indent=1) + "\n")
    shutil.rmtree(work, ignore_errors=True)
    size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    print(f"wrote {out} ({size} bytes): {json.dumps(expected)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
