"""Epochs issued from the GPU (issue 10), measured in one interleaved run on one GPU.

decode: Qwen3-0.6B dimensions, bf16, random weights, a 512-token prompt, greedy, a checkpoint every token into a
DRAM log. Modes, interleaved round by round:
  graph_plain      the same captured decode step with no epochs and no writer (only the token copied out):
                   what a user runs without Concordia (vLLM/SGLang-style graph decode)
  graph_durable    graph decode, the token's epoch gathered in the graph, committed by the C writer
                   (core/_slotlog.c, GIL released); on_token after the commit
  graph_pipelined  the same, on_token at once, commits at most pipeline_depth=2 tokens behind
  graph_durable_py, graph_pipelined_py   the same with the Python writer thread (the fallback; shares the GIL)
  eager            today's path: the eager Python loop + Session.checkpoint every token (the reference)
Per mode: tokens/s (from the median inter-token time of the decode thread), p90, decode-thread host time per
token (its time minus its waits for the GPU and the writer) split into graph.replay() + event record and the
rest (slot read, token bookkeeping, submit, on_token), commit latency (slot handed -> epoch committed).

epoch256: a 256 MiB CUDA paged region, 1 page / 1% / 100% of its pages dirty (fresh random bytes), one
Runtime.checkpoint into a DRAM log: the new path (mapped, registered segments; the gathered pages DMA'd into
the log's own pages) vs today's (DtoH into pinned staging, then the append copies into the segment), and a
dense 256 MiB region both ways. GB/s = dirty bytes / the checkpoint call.

    python benchmarks/bench_graph_epochs.py [--tokens 96] [--rounds 3] [--out-dir benchmarks/results]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_llm  # noqa: E402
from benchreport import percentile, print_table, save_figure, write_results  # noqa: E402

MODES = ("graph_plain", "graph_durable", "graph_pipelined", "graph_durable_py", "graph_pipelined_py", "eager")
SDPA = "reproducible"  # Session(sdpa=): "reproducible" keeps every mode off cuDNN attention (not run-to-run exact)
SKIP = 4  # first tokens of a run not counted (the eager prefill token, capture, the writer's start)


def decode_once(model: Any, root: Path, mode: str, prompt: torch.Tensor, new: int) -> dict[str, Any]:
    from concordia_ft.integrations.graph_decode import GraphDecoder
    from concordia_ft.session import Session

    d = Path(tempfile.mkdtemp(dir=root))
    durability = mode.removeprefix("graph_").removesuffix("_py")
    kw: dict[str, Any] = {"decode": "eager"} if mode in ("eager", "graph_plain") else {
        "decode": "graph", "durability": durability}
    s = Session(model, d / "log", max_cache_len=prompt.shape[1] + new + 8, backend="dram",
                runtime_options=bench_llm.RT_OPTS, sdpa=SDPA, **kw)
    if mode == "graph_plain":
        s.decode = "auto"
        s._graph = GraphDecoder(s, with_epoch=False)
    elif mode.startswith("graph_"):
        s._graph = GraphDecoder(s, durability=durability, writer="python" if mode.endswith("_py") else "c")
    t0 = time.perf_counter()
    toks = s.generate(prompt, max_new_tokens=new)  # the config has no eos: every token is generated
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    assert len(toks) == new
    row: dict[str, Any] = {"table": "decode", "mode": mode, "tokens": new}
    if s._graph is not None:
        gs = s._graph.stats
        step = gs.token_s[SKIP:]
        host = gs.host_s[SKIP:]
        rep = gs.replay_s[SKIP:]
        book = [h - r for h, r in zip(host, rep, strict=True)]
        row.update(capture_ms=1e3 * gs.capture_s, backpressure_ms=1e3 * gs.backpressure_s, epochs=gs.epochs,
                   writer=gs.writer or "none", replay_ms_p50=1e3 * statistics.median(rep),
                   bookkeeping_ms_p50=1e3 * statistics.median(book), bookkeeping_ms_p90=1e3 * percentile(book, 90))
        if gs.commit_s:
            row.update(commit_ms_p50=1e3 * statistics.median(gs.commit_s[SKIP:]),
                       commit_ms_p90=1e3 * percentile(gs.commit_s[SKIP:], 90),
                       append_ms_p50=1e3 * statistics.median(gs.append_s[SKIP:]))
    else:
        step = s.stats.step_s[SKIP:]
        host = s.stats.checkpoint_s[SKIP:]  # the checkpoint call on the decode thread (its own host time)
        row.update(checkpoint_ms_p50=1e3 * statistics.median(host))
    row.update(step_ms_p50=1e3 * statistics.median(step), step_ms_p90=1e3 * percentile(step, 90),
               tokens_per_s=1 / statistics.median(step), host_ms_p50=1e3 * statistics.median(host),
               host_ms_p90=1e3 * percentile(host, 90), wall_s=wall)
    s.close()
    shutil.rmtree(d, ignore_errors=True)
    row["_tokens"] = toks
    return row


def bench_decode(root: Path, new: int, rounds: int, modes: tuple[str, ...] = MODES) -> list[dict[str, Any]]:
    model = bench_llm.build(bench_llm.qwen3_06b(), "cuda")
    print("model built", flush=True)
    prompt = torch.randint(0, model.config.vocab_size, (1, 512), generator=torch.Generator().manual_seed(1))
    decode_once(model, root, "graph_durable", prompt, 8)  # warm: kernels, modules, pinned memory
    decode_once(model, root, "eager", prompt, 8)
    per: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
    for _ in range(rounds):
        for m in modes:
            r = decode_once(model, root, m, prompt, new)
            per[m].append(r)
            print(f"run {m}: " + " ".join(f"{k}={v:.4f}" for k, v in r.items() if isinstance(v, float)),
                  flush=True)  # what a run killed at its time limit still leaves
    ref = per["eager" if "eager" in per else modes[0]][0]["_tokens"]
    rows = []
    for m in modes:
        rs = per[m]
        same = all(r["_tokens"] == ref for r in rs)
        keys = [k for k in rs[0] if isinstance(rs[0][k], float)]
        row = {"table": "decode", "mode": m, "tokens": new, "rounds": rounds, "tokens_equal_eager": same,
               "writer": rs[0].get("writer", "eager")}
        for k in keys:
            row[k] = statistics.median(r[k] for r in rs)
        rows.append(row)
    plain = next(r for r in rows if r["mode"] == "graph_plain")["tokens_per_s"]
    for r in rows:
        r["vs_graph_plain_pct"] = 100 * (r["tokens_per_s"] / plain - 1)
    del model
    torch.cuda.empty_cache()
    return rows


def _epoch_once(root: Path, mapped: str, kind: str, frac: str, region: torch.Tensor, flags: torch.Tensor,
                g: torch.Generator) -> dict[str, Any]:
    import concordia_ft as cft

    page = 4096
    d = Path(tempfile.mkdtemp(dir=root))
    # one segment holds every epoch of the case (no roll inside the timed epochs)
    rt = cft.Runtime(d / "log", fsync="never", backend="dram", compact_after_bytes=None, segment_max_bytes=2 << 30,
                     log_options={"mapped": mapped, "mapped_segment_bytes": 1280 << 20})
    if kind == "paged":
        flags.zero_()
        rt.register("r", region, "paged", block_bytes=page, dirty_blocks=flags, initially_zero=False)
    else:
        rt.register("r", region, "dense")
    rt.checkpoint()  # the full first epoch (and, mapped, the registration) outside the timer
    time.sleep(0.3)  # the spare segment (mapped) is prepared in the background: not inside the timed epochs
    n_pages = region.numel() // page
    n = {"1page": 1, "1pct": n_pages // 100, "100pct": n_pages}[frac]
    times = []
    for _ in range(3):
        pages = torch.randperm(n_pages, device="cuda", generator=g)[:n]
        view = region.view(n_pages, page)
        view[pages] = torch.randint(0, 256, (n, page), dtype=torch.uint8, device="cuda", generator=g)
        if kind == "paged":
            flags[pages] = 1
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        rt.checkpoint()
        times.append(time.perf_counter() - t0)
    st = rt.last_stats
    rt.close()
    ok = bool(_check(d / "log", region))
    shutil.rmtree(d, ignore_errors=True)
    t = statistics.median(times)
    return {"table": f"epoch256_{kind}", "path": "new (DMA into the mapped log)" if mapped == "on" else "today",
            "dirty": frac, "dirty_bytes": n * page, "checkpoint_ms": 1e3 * t, "gb_per_s": n * page / t / 1e9,
            "detect_ms": 1e3 * st.detect_seconds, "append_ms": 1e3 * st.append_seconds, "replay_equal": ok}


def _check(log: Path, region: torch.Tensor) -> bool:
    import numpy as np

    from concordia_ft.core.replay import replay

    r = replay(log)
    return bool(np.array_equal(r.regions["r"].data[: region.numel()], region.cpu().numpy()))


def bench_epoch256(root: Path, rounds: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    g = torch.Generator(device="cuda").manual_seed(2)
    region = torch.randint(0, 256, (256 << 20,), dtype=torch.uint8, device="cuda", generator=g)
    flags = torch.zeros(region.numel() // 4096, dtype=torch.uint8, device="cuda")
    new: list[dict[str, Any]] = []
    base: list[dict[str, Any]] = []
    cases = [("paged", f) for f in ("1page", "1pct", "100pct")] + [("dense", "100pct")]
    for _ in range(rounds):
        for kind, frac in cases:
            new.append(_epoch_once(root, "on", kind, frac, region, flags, g))
            base.append(_epoch_once(root, "off", kind, frac, region, flags, g))

    def med(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
        out = []
        for kind, frac in cases:
            rs = [r for r in rows if r["table"] == f"epoch256_{kind}" and r["dirty"] == frac]
            m = dict(rs[0])
            for k in ("checkpoint_ms", "gb_per_s", "detect_ms", "append_ms"):
                m[k] = statistics.median(r[k] for r in rs)
            m["replay_equal"] = all(r["replay_equal"] for r in rs)
            m["rounds"] = len(rs)
            out.append(m)
        return out

    n, b = med(new), med(base)
    for x, y in zip(n, b, strict=True):
        x["speedup_vs_today"] = y["checkpoint_ms"] / x["checkpoint_ms"]
    return n, b


def plot(path: Path) -> Path:
    """Four panels from a results JSON: tokens/s, decode-thread host ms per token, commit latency, GB/s."""
    import json

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    doc = json.loads(path.read_text())
    dec = [r for r in doc["rows"] + doc["baseline"] if r.get("table") == "decode"]
    new = [r for r in doc["rows"] if str(r.get("table", "")).startswith("epoch256")]
    old = [r for r in doc["baseline"] if str(r.get("table", "")).startswith("epoch256")]
    fig, ax = plt.subplots(2, 2, figsize=(12, 7))
    modes = [r["mode"] for r in dec]
    ax[0, 0].barh(modes, [r["tokens_per_s"] for r in dec], color=["tab:gray" if m == "eager" else "tab:blue"
                                                                  for m in modes])
    ax[0, 0].set_title("decode tokens/s (checkpoint every token; graph_plain: none)", fontsize=9)
    ax[0, 1].barh(modes, [r["host_ms_p50"] for r in dec], color="tab:orange", label="p50")
    ax[0, 1].barh(modes, [r["host_ms_p90"] - r["host_ms_p50"] for r in dec], left=[r["host_ms_p50"] for r in dec],
                  color="tab:red", alpha=0.4, label="p90")
    ax[0, 1].axvline(0.05, color="k", ls="--", lw=0.8, label="target 0.05 ms")
    ax[0, 1].set_xscale("log")
    ax[0, 1].set_title("decode-thread host ms per token (eager: the checkpoint call)", fontsize=9)
    ax[0, 1].legend(fontsize=7)
    gm = [r for r in dec if "commit_ms_p50" in r]
    ax[1, 0].barh([r["mode"] for r in gm], [r["commit_ms_p50"] for r in gm], color="tab:green", label="p50")
    ax[1, 0].barh([r["mode"] for r in gm], [r["commit_ms_p90"] - r["commit_ms_p50"] for r in gm],
                  left=[r["commit_ms_p50"] for r in gm], color="tab:green", alpha=0.4, label="p90")
    ax[1, 0].set_title("commit latency ms (slot handed -> epoch committed)", fontsize=9)
    ax[1, 0].legend(fontsize=7)
    labels = [f"{r['table'].removeprefix('epoch256_')} {r['dirty']}" for r in new]
    y = range(len(labels))
    ax[1, 1].barh([i + 0.2 for i in y], [r["gb_per_s"] for r in new], height=0.4, label="new: DMA into the log")
    ax[1, 1].barh([i - 0.2 for i in y], [r["gb_per_s"] for r in old], height=0.4, color="tab:gray", label="today")
    ax[1, 1].set_yticks(list(y), labels)
    ax[1, 1].axvline(20, color="k", ls="--", lw=0.8, label="target 20 GB/s")
    ax[1, 1].set_xscale("log")
    ax[1, 1].set_title("256 MiB region: one epoch into the DRAM log, GB/s", fontsize=9)
    ax[1, 1].legend(fontsize=7)
    for a in ax.flat:
        a.tick_params(labelsize=7)
    out = save_figure(fig, doc, path, "graph_epochs", fontsize=10)
    plt.close(fig)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--only", default="decode,epoch256")
    ap.add_argument("--modes", default=",".join(MODES), help="decode modes to run (graph_plain is the reference)")
    ap.add_argument("--out-dir", default="benchmarks/results")
    ap.add_argument("--sdpa", default="reproducible", choices=("reproducible", "default"),
                    help="Session(sdpa=): 'default' lets torch pick cuDNN attention (then no two runs need agree)")
    ap.add_argument("--plot", default=None, help="only draw this results JSON as a PNG beside it")
    a = ap.parse_args()
    if a.plot:
        print("wrote", plot(Path(a.plot)))
        return 0
    only = set(a.only.split(","))
    global SDPA
    SDPA = a.sdpa
    root = Path(tempfile.mkdtemp(dir="/dev/shm", prefix="cft-bench-graph-"))
    rows: list[dict[str, Any]] = []
    baseline: list[dict[str, Any]] = []
    try:
        if "decode" in only:
            modes = tuple(m for m in MODES if m in a.modes.split(",") or m == "graph_plain")
            d = bench_decode(root, a.tokens, a.rounds, modes)
            for r in d:
                r.pop("_tokens", None)
            print_table("decode (Qwen3-0.6B dims bf16, 512-token prompt, checkpoint every token)", d,
                        ["mode", "writer", "tokens_per_s", "vs_graph_plain_pct", "step_ms_p50", "host_ms_p50",
                         "host_ms_p90", "replay_ms_p50", "bookkeeping_ms_p50", "commit_ms_p50", "commit_ms_p90",
                         "tokens_equal_eager"])
            rows += [r for r in d if r["mode"] != "eager"]
            baseline += [r for r in d if r["mode"] == "eager"]
        if "epoch256" in only:
            n, b = bench_epoch256(root, a.rounds)
            print_table("256 MiB region, one epoch into the DRAM log: new", n,
                        ["table", "dirty", "checkpoint_ms", "gb_per_s", "speedup_vs_today", "replay_equal"])
            print_table("256 MiB region, one epoch into the DRAM log: today", b,
                        ["table", "dirty", "checkpoint_ms", "gb_per_s", "replay_equal"])
            rows += n
            baseline += b
    finally:
        shutil.rmtree(root, ignore_errors=True)
    path = write_results("graph_epochs", rows, baseline=baseline, out_dir=a.out_dir,
                         notes="issue 10: graph decode with in-graph token epochs; payloads DMA'd into the log; "
                         f"Session(sdpa={SDPA!r}): tokens_equal_eager compares every run with the first eager run")
    print("wrote", path)
    try:
        print("wrote", plot(path))
    except ImportError:
        print("no matplotlib: run with --plot", path, "where it is installed")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
