"""Where does the ~1 ms of a per-token decode checkpoint go? cProfile of ``Session.checkpoint`` over a decode
of the bench_llm setup (Qwen3-0.6B dims, bf16, random weights, DRAM log, a checkpoint every token), plus the
runtime's own phase timings per token (detect, append) and the step time it is compared against.

Usage: python experiments/probe_decode_ckpt_profile.py [--tokens 48] [--device cuda]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_llm  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--device", default="cuda")
    a = ap.parse_args()
    import torch

    from concordia_ft.session import Session

    model = bench_llm.build(bench_llm.qwen3_06b(), a.device)
    prompt = torch.randint(0, model.config.vocab_size, (1, 128), generator=torch.Generator().manual_seed(1))
    root = Path(tempfile.mkdtemp(dir="/dev/shm"))
    for k, n in enumerate((8, a.tokens)):  # a warm-up session (kernels, handler modules), then the profiled one
        s = Session(model, root / f"log{k}", checkpoint_every=1, max_cache_len=prompt.shape[1] + n + 8,
                    backend="dram", runtime_options=bench_llm.RT_OPTS)
        prof = cProfile.Profile()
        calls: list[float] = []
        orig = s.checkpoint

        def profiled(orig=orig, prof=prof, calls=calls) -> int:  # type: ignore[no-untyped-def]
            t0 = time.perf_counter()
            prof.enable()
            try:
                return orig()
            finally:
                prof.disable()
                calls.append(1e3 * (time.perf_counter() - t0))

        s.checkpoint = profiled  # type: ignore[method-assign]
        s.generate(prompt, max_new_tokens=n, eos_token_ids=())
        bench_llm.sync(a.device)
        st = s.stats
        if k == 0:
            s.close()
            continue
        med = statistics.median
        print(f"checkpoint ms per token: median {med(calls[2:]):.3f}, all {[round(c, 3) for c in calls[:12]]}")
        print(f"decode step ms median {1e3 * med(st.step_s[1:]):.2f}; detect ms {1e3 * med(st.detect_s[2:]):.3f}; "
              f"append ms {1e3 * med(st.append_s[2:]):.3f}; pages/token {med(st.epoch_pages[2:])}")
        rt = s.runtime
        print("regions:", [(name, tr.spec.kind.value, tr.spec.nbytes) for name, tr in rt._trackers.items()
                           if tr.spec.kind.value != "immutable"][:12])
        ps = pstats.Stats(prof)
        ps.sort_stats("tottime").print_stats(30)
        ps.sort_stats("cumulative").print_stats(35)
        s.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
