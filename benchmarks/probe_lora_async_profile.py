"""Where do the ~0.8 ms of an asynchronous LoRA epoch's call on the training thread go? cProfile of
``Runtime.checkpoint_async`` over a few steps of the bench_llm LoRA setup (Qwen2.5-0.5B dims, r=8, AdamW).

Usage: python benchmarks/probe_lora_async_profile.py [--steps 12]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_llm  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=12)
    a = ap.parse_args()
    from concordia_ft.integrations.peft import LoraTrainer, synthetic_batch

    cfg, seq, _ = bench_llm.lora_config("cuda", False)
    base = bench_llm.build(cfg, "cuda")
    d = Path(tempfile.mkdtemp(dir="/dev/shm"))
    t = LoraTrainer(base, d / "log", lr=1e-4, backend="dram", log_weights=True, async_checkpoint=True,
                    runtime_options=bench_llm.RT_OPTS)
    rt = t.runtime
    orig = rt.checkpoint_async
    prof = cProfile.Profile()
    calls: list[float] = []

    def profiled(*args, **kw):  # type: ignore[no-untyped-def]
        t0 = time.perf_counter()
        prof.enable()
        try:
            return orig(*args, **kw)
        finally:
            prof.disable()
            calls.append(1e3 * (time.perf_counter() - t0))

    for k in range(3):
        t.train_step(synthetic_batch(k, vocab=cfg.vocab_size, seq=seq, device="cuda"))
    t.wait()
    rt.checkpoint_async = profiled  # type: ignore[method-assign]
    for k in range(3, 3 + a.steps):
        t.train_step(synthetic_batch(k, vocab=cfg.vocab_size, seq=seq, device="cuda"))
    t.wait()
    print("checkpoint_async ms:", [round(c, 3) for c in calls])
    print("regions:", [(n, tr.spec.kind.value, tr.spec.nbytes) for n, tr in rt._trackers.items()
                       if tr.spec.kind.value != "immutable"][:20], "n trackers", len(rt._trackers))
    st = pstats.Stats(prof)
    st.sort_stats("tottime").print_stats(25)
    st.sort_stats("cumulative").print_stats(25)
    t.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
