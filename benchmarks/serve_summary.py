"""One line per concurrency of a bench_serve.py results JSON: tok/s and cost per epoch mode, p50/p99 step time."""

from __future__ import annotations

import json
import sys


def main(path: str) -> None:
    d = json.load(open(path))
    print("commit", d.get("git_commit"), d["device"].get("gpu"))
    for r in d["rows"]:
        if r.get("part") != "throughput":
            continue
        modes = [k[len("tok_s_"):] for k in r if k.startswith("tok_s_")]
        parts = [f"n={r['concurrent']}"]
        for m in modes:
            cost = r.get(f"cost_{m}_pct")
            parts.append(f"{m}: {r[f'tok_s_{m}']:.0f} tok/s" + (f" ({cost:+.1f}%)" if cost is not None else "")
                         + f" p50 {r[f'itl_p50_ms_{m}']:.2f}/p99 {r[f'itl_p99_ms_{m}']:.2f} ms")
        parts.append(f"bytes/step {r.get('bytes_per_step_c', r['bytes_per_step']):.0f}; tokens equal "
                     f"{r['tokens_equal_all_runs']}")
        print(" | ".join(parts))
        for m in modes:
            t = {k[len("step_epoch_"):-len(m) - 1]: v for k, v in r.items() if k.startswith("step_epoch_")
                 and k.endswith("_" + m)}
            if t:
                print(f"    {m} host per step epoch: " + ", ".join(f"{k} {v:.3f}" for k, v in t.items()))


if __name__ == "__main__":
    main(sys.argv[1])
