"""Where graph decode and the eager loop stop agreeing on Qwen3-0.6B dims bf16 (random weights): tokens of
the same greedy decode by (A) the eager Session loop, (B) an eager loop passing cache_position, (C) the graph
decoder's step run eagerly (not captured), (D) the captured graph; each also with cuDNN SDPA disabled.

Usage: python experiments/probe_graph_exact.py [--tokens 48]"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_llm  # noqa: E402


def first_diff(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--tokens", type=int, default=48)
    a = ap.parse_args()
    from concordia_ft.integrations.graph_decode import GraphDecoder
    from concordia_ft.session import Session

    model = bench_llm.build(bench_llm.qwen3_06b(), "cuda")
    prompt = torch.randint(0, model.config.vocab_size, (1, 512), generator=torch.Generator().manual_seed(3))
    root = Path(tempfile.mkdtemp(dir="/dev/shm"))
    n = a.tokens

    def session(tag: str, decode: str) -> Session:
        return Session(model, root / tag, max_cache_len=512 + n + 8, backend="dram", decode=decode)

    for cudnn in (True, False):
        torch.backends.cuda.enable_cudnn_sdp(cudnn)
        sfx = f"-cudnn{int(cudnn)}"
        ref = session("A" + sfx, "eager")
        A = ref.generate(prompt, max_new_tokens=n)
        ref.close()
        out = {"A_eager_session": A}
        # B: the eager loop by hand, cache_position passed (the graph's call), default stream
        s = session("B" + sfx, "eager")
        s.generate(prompt, max_new_tokens=1)
        kw = {"use_cache": True, "logits_to_keep": 1, s.cache_kw: s.cache}
        toks = [int(s.tokens[s.n_tokens - 1])]
        with torch.inference_mode():
            for _ in range(n - 1):
                L = int(s.cache.get_seq_length())
                ids = torch.tensor([[toks[-1]]], device="cuda")
                if s.cache_position_kw:
                    kw["cache_position"] = torch.tensor([L], device="cuda")
                lg = model(input_ids=ids, **kw).logits[:, -1].to(copy=True, dtype=torch.float32)
                toks.append(int(torch.argmax(lg, dim=-1).item()))
        out["B_eager_cache_position"] = toks
        s.close()
        # C: the decoder's own step function, run eagerly; D: captured
        for tag, captured in (("C_step_uncaptured", False), ("D_graph", True)):
            s = session(tag + sfx, "eager")
            s.generate(prompt, max_new_tokens=1)
            dec = GraphDecoder(s, with_epoch=False)
            L = s.n_tokens - 1
            toks = [int(s.tokens[L])]
            with torch.inference_mode():
                if captured:
                    dec.capture(toks[0], L)
                else:
                    dec.set_state(toks[0], L)
                for _ in range(n - 1):
                    if captured:
                        dec.graph.replay()
                    else:
                        dec._step()
                    toks.append(int(dec.tok.item()))
            out[tag] = toks
            dec.close()
            s.close()
        for k, v in out.items():
            print(f"cudnn_sdp={cudnn} {k:24s} first diff vs A: {first_diff(v, A)}  vs D: {first_diff(v, out['D_graph'])}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
