"""Which driver entries torch.cuda.synchronize reaches (the interposer in trace mode counts every driver call by
CUPTI callback name). Runs itself in a child with the interposer loaded by the driver; no executor, so nothing
can block.  Run: python3 experiments/probe_sync_entry.py"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))


def child() -> None:
    import torch

    from concordia_lab.instrument import interposer as ip

    torch.ones(4, device="cuda").mul_(2)
    torch.cuda.synchronize()

    def calls() -> dict[str, int]:
        return dict(ip.snapshot()["guard"]["trace_calls"])

    out = {}
    for name, fn in (("synchronize", torch.cuda.synchronize), ("empty_cache", torch.cuda.empty_cache)):
        before = calls()
        fn()
        after = calls()
        out[name] = {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)}
    out["hazard_calls"] = {k: v for k, v in ip.snapshot()["guard"]["calls"].items() if v}
    print(json.dumps(out))


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child()
        return 0
    from concordia_lab.instrument import interposer as ip

    env = ip.child_env()
    env["CONCORDIA_GUARD_TRACE"] = "1"
    env["PYTHONPATH"] = f"{ROOT / 'src'}:{env.get('PYTHONPATH', '')}"
    r = subprocess.run([sys.executable, __file__, "--child"], env=env, capture_output=True, text=True, timeout=120)
    print(r.stdout.strip() or r.stderr[-2000:])
    return r.returncode


if __name__ == "__main__":
    raise SystemExit(main())
