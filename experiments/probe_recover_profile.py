"""Where does Session.recover spend the time that is neither verify, copy nor restore ("other" in
bench_llm's recovery rows), and can one decode step be captured as a CUDA graph (the first token after
recovery is one eager decode step)? Prints a cProfile of one warm recovery and the capture outcome.

Usage: python experiments/probe_recover_profile.py [--prompt 2000]
"""

from __future__ import annotations

import argparse
import cProfile
import inspect
import pstats
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_llm  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--prompt", type=int, default=2000)
    a = ap.parse_args()
    from concordia_ft.session import Session

    dev = "cuda"
    model = bench_llm.build(bench_llm.qwen3_06b(), dev)
    root = Path(tempfile.mkdtemp(dir="/dev/shm"))
    log = root / "log"
    prompt = torch.randint(0, model.config.vocab_size, (1, a.prompt), generator=torch.Generator().manual_seed(2))
    s = Session(model, log, max_cache_len=a.prompt + 64, backend="dram", runtime_options=bench_llm.RT_OPTS)
    n = [0]

    def stop(tok: int) -> None:
        n[0] += 1
        if n[0] == 12:
            raise KeyboardInterrupt

    try:
        s.generate(prompt, max_new_tokens=24, eos_token_ids=(), on_token=stop)
    except KeyboardInterrupt:
        pass
    lengths = s.cache.lengths()
    s.runtime.close()
    del s

    def fresh() -> Path:
        d = root / "rep"
        shutil.rmtree(d, ignore_errors=True)
        shutil.copytree(log, d)
        (d / "LOCK").unlink(missing_ok=True)
        return d

    for _ in range(2):  # warm: pinned cache, modules, allocator
        bench_llm._warm_decode(model, dev, a.prompt + 64, lengths)
        r = Session.recover(fresh(), model, backend="dram", runtime_options=bench_llm.RT_OPTS)
        r.runtime.close()
    bench_llm._warm_decode(model, dev, a.prompt + 64, lengths)
    d = fresh()
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    r = Session.recover(d, model, backend="dram", runtime_options=bench_llm.RT_OPTS)
    prof.disable()
    t1 = time.perf_counter()
    print(f"Session.recover {1e3 * (t1 - t0):.1f} ms; timings {r.recovered.timings}")
    st = pstats.Stats(prof)
    st.sort_stats("cumulative").print_stats(35)
    st.sort_stats("tottime").print_stats(20)

    # CUDA graph capture of one decode step on the recovered cache
    cache = r.cache
    kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    L = int(cache.get_seq_length())
    ids = torch.zeros((1, 1), dtype=torch.long, device=dev)
    pos = torch.tensor([L], dtype=torch.long, device=dev)

    def step() -> torch.Tensor:
        return model(input_ids=ids, cache_position=pos, use_cache=True, logits_to_keep=1, **{kw: cache}).logits

    with torch.inference_mode():
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                step()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        t = time.perf_counter()
        eager = step()
        torch.cuda.synchronize()
        eager_ms = 1e3 * (time.perf_counter() - t)
        try:
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                out = step()
            torch.cuda.synchronize()
            ts = []
            for _ in range(10):
                t = time.perf_counter()
                g.replay()
                torch.cuda.synchronize()
                ts.append(1e3 * (time.perf_counter() - t))
            g.replay()
            ref = step()
            torch.cuda.synchronize()
            print(f"CUDA graph capture OK: replay {sorted(ts)[5]:.2f} ms vs eager {eager_ms:.2f} ms; "
                  f"same logits: {torch.equal(out, ref)}; eager shape {tuple(eager.shape)}")
        except Exception as e:  # noqa: BLE001 - the probe reports what fails
            print(f"CUDA graph capture FAILED: {type(e).__name__}: {str(e)[:800]}")
    r.runtime.close()
    shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
