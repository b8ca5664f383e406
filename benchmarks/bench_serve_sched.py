"""Scheduling over the paged KV pool: prefix caching on multi-turn agent traffic, and growing admission with
preemption against whole-budget reservation, through serve.Engine with an epoch every step (a real log).

1. agent: C conversations share a system prompt of S tokens; each turn sends the whole conversation so far
   (system prompt, every earlier user message and answer, token for token) plus a new user message of U tokens
   and gets an answer of A tokens (greedy). TTFT = submit to the step output holding the turn's first token.
   (a) isolated: turns one at a time, prefix cache on and off; the ratio of a cached turn's TTFT to the same
       turn's uncached TTFT (turn 1 of conversations after the first: the system prompt is cached; later turns:
       the system prompt and the history are);
   (b) traffic: all conversations at once, each sending its next turn as soon as its answer is complete:
       TTFT p50/p90 of turns with a cached prefix, output tokens/s, prefill tokens computed; cache on and off.
2. admission: Poisson arrivals (rate R/s, saturating: the queue does not empty) of prompts ~U(Pmin, Pmax) with
   max_tokens M and output lengths lognormal (median, sigma) capped at M. The driver ends a request at its drawn
   length as its EOS would (Engine.abort right after that token: a random-weight model's EOS cannot be steered,
   and the engine must not know the length in advance, or reservation could reserve exactly it). The same pool,
   admission "grow" (blocks as a request grows, preemption) against "reserve" (prompt + max_tokens at
   admission): requests running per step while requests wait (mean, max), output tokens/s, TTFT p50/p90,
   preemptions.

    python benchmarks/bench_serve_sched.py                               # CPU defaults (small random Qwen3 dims)
    python benchmarks/bench_serve_sched.py --device cuda --dims 0.6b --conversations 32 --turns 4 \\
        --num-blocks 4096 --requests 256 --rate 64                       # the H200 run
    python benchmarks/bench_serve_sched.py --quick                       # a few seconds, to check the script
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

import torch  # noqa: E402
from benchreport import median, percentile, print_table, write_results  # noqa: E402

from concordia_ft.serve import Engine, SamplingParams  # noqa: E402


def config(dims: str) -> Any:
    from transformers import Qwen3Config

    if dims == "0.6b":
        return Qwen3Config(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                           num_attention_heads=16, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True)
    if dims == "small":  # the CPU default: compute, not Python, dominates a 2k-token prefill
        return Qwen3Config(vocab_size=2048, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=64)
    return Qwen3Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16)  # "tiny"


def build(dims: str, device: str) -> Any:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config(dims), dtype=dtype)
    with torch.no_grad():  # random init is small: scale up so that the logits are not all ties
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.05)
    return model.eval()


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


class LogDir:
    """A fresh log directory per engine (tmpfs when there is room), removed after."""

    def __init__(self, need_bytes: int) -> None:
        shm = Path("/dev/shm")
        parent = shm if shm.is_dir() and shutil.disk_usage(shm).free > 2 * need_bytes else None
        self.path = Path(tempfile.mkdtemp(prefix="cft-sched-", dir=parent)) / "log"

    def close(self) -> None:
        shutil.rmtree(self.path.parent, ignore_errors=True)


def engine(model: Any, opts: dict[str, Any], log: bool) -> tuple[Engine, LogDir | None]:
    if not log:
        return Engine(model, None, {**opts, "checkpoint": False}), None
    d = LogDir(1 << 30)
    return Engine(model, d.path, opts), d


def rand_ids(g: torch.Generator, n: int, vocab: int) -> list[int]:
    return torch.randint(3, vocab, (n,), generator=g).tolist()


# -- 1. agent traffic ----------------------------------------------------------------------------------------
def agent_turns(a: argparse.Namespace, vocab: int) -> tuple[list[int], list[list[list[int]]]]:
    g = torch.Generator().manual_seed(a.seed)
    system = rand_ids(g, a.system, vocab)
    users = [[rand_ids(g, a.user, vocab) for _ in range(a.turns)] for _ in range(a.conversations)]
    return system, users


def run_agent_isolated(model: Any, a: argparse.Namespace, opts: dict[str, Any], vocab: int, device: str
                       ) -> list[dict[str, Any]]:
    """Turns one at a time: per turn, TTFT and the prefill tokens its first step computed."""
    system, users = agent_turns(a, vocab)
    eng, d = engine(model, opts, a.log)
    rows = []
    try:
        for c in range(a.conversations):
            history = list(system)
            for t in range(a.turns):
                prompt = history + users[c][t]
                sync(device)
                t0, c0 = time.perf_counter(), time.process_time()
                r = eng.submit(prompt, SamplingParams(max_new_tokens=a.answer, temperature=0.0, ignore_eos=True))
                computed = 0
                while not r.generated:
                    computed += eng.step().batch_tokens
                sync(device)
                ttft, ttft_cpu = time.perf_counter() - t0, time.process_time() - c0
                while r.status != "finished":
                    eng.step()
                rows.append({"conversation": c, "turn": t, "prompt": len(prompt), "ttft_s": ttft,
                             "ttft_cpu_s": ttft_cpu, "computed": computed})
                history = prompt + r.generated
    finally:
        eng.close()
        if d is not None:
            d.close()
    return rows


def run_agent_traffic(model: Any, a: argparse.Namespace, opts: dict[str, Any], vocab: int, device: str
                      ) -> dict[str, Any]:
    """Every conversation at once; each sends its next turn when its answer is complete."""
    system, users = agent_turns(a, vocab)
    eng, d = engine(model, opts, a.log)
    turn = [0] * a.conversations
    history = [list(system) for _ in range(a.conversations)]
    live: dict[str, tuple[int, float, list[int]]] = {}  # request id -> (conversation, submit time, prompt)
    ttft: list[tuple[int, float]] = []
    out_tokens = computed = steps = 0

    def send(c: int) -> None:
        prompt = history[c] + users[c][turn[c]]
        r = eng.submit(prompt, SamplingParams(max_new_tokens=a.answer, temperature=0.0, ignore_eos=True))
        live[r.id] = (c, time.perf_counter(), prompt)

    try:
        t0, c0 = time.perf_counter(), time.process_time()
        for c in range(a.conversations):
            send(c)
        while eng.has_work:
            o = eng.step()
            steps += 1
            now = time.perf_counter()
            computed += o.batch_tokens
            for rid, toks in o.new_tokens.items():
                out_tokens += len(toks)
                if o.starts.get(rid) == 0:
                    c = live[rid][0]
                    ttft.append((turn[c], now - live[rid][1]))
            for rid in o.finished:
                c, _, prompt = live.pop(rid)
                r = eng.get(rid)
                assert r is not None
                history[c] = prompt + r.generated
                turn[c] += 1
                if turn[c] < a.turns:
                    send(c)
        sync(device)
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    finally:
        eng.close()
        if d is not None:
            d.close()
    later = [s for t, s in ttft if t > 0]
    return {"wall_s": wall, "cpu_s": cpu, "steps": steps, "output_tokens": out_tokens,
            "tokens_per_s": out_tokens / wall, "tokens_per_cpu_s": out_tokens / cpu,
            "prefill_computed": computed - out_tokens, "ttft_p50_s": median(s for _, s in ttft),
            "ttft_p90_s": percentile([s for _, s in ttft], 90),
            "ttft_turn2plus_p50_s": median(later) if later else float("nan"),
            "ttft_turn2plus_p90_s": percentile(later, 90) if later else float("nan"),
            "hit_blocks": eng.blocks.hits}


# -- 2. admission ----------------------------------------------------------------------------------------------
def arrivals(a: argparse.Namespace, vocab: int) -> list[tuple[float, list[int], int]]:
    """``(arrival time s, prompt, output length)``: Poisson arrivals, lognormal output lengths capped at M."""
    g = torch.Generator().manual_seed(a.seed + 1)
    t, out = 0.0, []
    for _ in range(a.requests):
        t += float(-math.log(1.0 - float(torch.rand((), generator=g))) / a.rate)
        plen = int(torch.randint(a.prompt_min, a.prompt_max + 1, (), generator=g))
        z = float(torch.randn((), generator=g))
        n = max(1, min(a.max_tokens, int(round(a.output_median * math.exp(a.output_sigma * z)))))
        out.append((t, rand_ids(g, plen, vocab), n))
    return out


def run_admission(model: Any, a: argparse.Namespace, mode: str, cache: bool, vocab: int, device: str
                  ) -> dict[str, Any]:
    plan = arrivals(a, vocab)
    opts = {"num_blocks": a.adm_blocks, "block_size": 16, "max_running": a.max_running,
            "max_waiting": a.requests, "max_model_len": a.prompt_max + a.max_tokens,
            "max_batch_tokens": a.max_batch_tokens, "admission": mode, "prefix_caching": cache}
    eng, d = engine(model, opts, a.log)
    want: dict[str, int] = {}
    sent: dict[str, float] = {}
    ttft: list[float] = []
    held: list[int] = []  # running requests after each step while some wait
    out_tokens = steps = computed = 0
    try:
        i = 0
        t0, c0 = time.perf_counter(), time.process_time()
        while i < len(plan) or eng.has_work:
            now = time.perf_counter() - t0
            while i < len(plan) and plan[i][0] <= now:
                r = eng.submit(plan[i][1], SamplingParams(max_new_tokens=a.max_tokens, temperature=0.0,
                                                          ignore_eos=True), request_id=f"q{i:04d}")
                want[r.id], sent[r.id] = plan[i][2], time.perf_counter()
                i += 1
            if not eng.has_work:
                time.sleep(max(0.0, min(plan[i][0] - now, 0.01)))
                continue
            o = eng.step()
            steps += 1
            computed += o.batch_tokens
            stamp = time.perf_counter()
            for rid, toks in o.new_tokens.items():
                out_tokens += len(toks)
                if o.starts.get(rid) == 0:
                    ttft.append(stamp - sent[rid])
                r = eng.get(rid)
                if r is not None and r.status != "finished" and len(r.generated) >= want[rid]:
                    eng.abort(rid)  # its EOS
            if eng.waiting:
                held.append(len(eng.running))
        sync(device)
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    finally:
        eng.close()
        if d is not None:
            d.close()
    return {"admission": mode, "prefix_caching": cache, "wall_s": wall, "cpu_s": cpu, "steps": steps, "output_tokens": out_tokens,
            "tokens_per_s": out_tokens / wall, "tokens_per_cpu_s": out_tokens / cpu, "held_mean": sum(held) / len(held) if held else float("nan"),
            "held_max": max(held) if held else 0, "steps_with_queue": len(held),
            "ttft_p50_s": median(ttft), "ttft_p90_s": percentile(ttft, 90), "preempted": eng.preempted,
            "mean_output": sum(want.values()) / len(want), "prompt_tokens": sum(len(x[1]) for x in plan),
            "prefill_computed": computed - out_tokens, "hit_blocks": eng.blocks.hits}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dims", default="small", choices=["tiny", "small", "0.6b"])
    p.add_argument("--only", choices=["agent", "admission"], default=None)
    p.add_argument("--no-log", dest="log", action="store_false", help="engines without a log (default: a log)")
    p.add_argument("--seed", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="tiny dims, a few requests: checks the script")
    g = p.add_argument_group("agent")
    g.add_argument("--conversations", type=int, default=8)
    g.add_argument("--turns", type=int, default=3)
    g.add_argument("--system", type=int, default=2048, help="system prompt tokens")
    g.add_argument("--user", type=int, default=48, help="tokens of each user message")
    g.add_argument("--answer", type=int, default=24, help="tokens of each answer")
    g.add_argument("--num-blocks", type=int, default=1024, help="pool blocks (16 slots each) for the agent runs")
    g = p.add_argument_group("admission")
    g.add_argument("--requests", type=int, default=96)
    g.add_argument("--rate", type=float, default=40.0, help="Poisson arrivals per second")
    g.add_argument("--prompt-min", type=int, default=32)
    g.add_argument("--prompt-max", type=int, default=192)
    g.add_argument("--max-tokens", type=int, default=512)
    g.add_argument("--output-median", type=float, default=64.0)
    g.add_argument("--output-sigma", type=float, default=0.9)
    g.add_argument("--adm-blocks", type=int, default=256, help="pool blocks (16 slots each) for both admissions")
    g.add_argument("--max-running", type=int, default=64)
    g.add_argument("--max-batch-tokens", type=int, default=2048)
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    p.add_argument("--name", default="serve_sched", help="results file name (before -<device tag>.json)")
    a = p.parse_args()
    if a.quick:
        a.dims, a.conversations, a.turns, a.system, a.user, a.answer = "tiny", 3, 2, 256, 16, 8
        a.requests, a.max_tokens, a.adm_blocks, a.prompt_max, a.output_median = 16, 64, 32, 48, 16.0
    if a.device == "cpu":
        torch.set_num_threads(1)  # a shared CPU: CPU seconds are the steadier measure; one thread keeps them wall
    model = build(a.dims, a.device)
    vocab = int(model.config.vocab_size)
    torch.set_grad_enabled(False)
    doc: dict[str, Any] = {"args": vars(a)}
    rows: list[dict[str, Any]] = []

    if a.only in (None, "agent"):
        max_len = a.system + a.turns * (a.user + a.answer) + 16
        opts = {"num_blocks": a.num_blocks, "block_size": 16, "max_running": max(8, a.conversations),
                "max_waiting": 4 * a.conversations, "max_model_len": max_len, "max_batch_tokens": 2048}
        iso = {}
        for cache in (False, True):
            iso[cache] = run_agent_isolated(model, a, {**opts, "prefix_caching": cache}, vocab, a.device)
        pairs = [(on, off) for on, off in zip(iso[True], iso[False], strict=True) if (on["conversation"], on["turn"])
                 != (0, 0)]
        def ratios(key: str, turn: Any = None) -> list[float]:
            return [on[key] / off[key] for on, off in pairs if turn is None or (on["turn"] > 0) == turn]

        iso_row = {"case": "agent isolated", "turns_compared": len(pairs),
                   "ttft_uncached_p50_s": median(off["ttft_s"] for _, off in pairs),
                   "ttft_cached_p50_s": median(on["ttft_s"] for on, _ in pairs),
                   "ttft_uncached_cpu_p50_s": median(off["ttft_cpu_s"] for _, off in pairs),
                   "ttft_cached_cpu_p50_s": median(on["ttft_cpu_s"] for on, _ in pairs),
                   "ratio_p50": median(ratios("ttft_s")), "ratio_max": max(ratios("ttft_s")),
                   "ratio_cpu_p50": median(ratios("ttft_cpu_s")), "ratio_cpu_max": max(ratios("ttft_cpu_s")),
                   "ratio_cpu_system_hit_p50": median(ratios("ttft_cpu_s", False) or [float("nan")]),
                   "ratio_cpu_history_hit_p50": median(ratios("ttft_cpu_s", True) or [float("nan")]),
                   "computed_uncached": sum(off["computed"] for _, off in pairs),
                   "computed_cached": sum(on["computed"] for on, _ in pairs),
                   "target_ratio_le": 0.2}
        rows.append(iso_row)
        doc["agent_isolated_turns"] = {"cached": iso[True], "uncached": iso[False]}
        for cache in (False, True):
            rows.append({"case": f"agent traffic, prefix cache {'on' if cache else 'off'}",
                         **run_agent_traffic(model, a, {**opts, "prefix_caching": cache}, vocab, a.device)})

    if a.only in (None, "admission"):
        # reserve without a cache: the engine before growing admission; grow with the cache: today's default
        modes = {"reserve": ("reserve", False), "grow": ("grow", False), "grow+cache": ("grow", True)}
        adm = {k: run_admission(model, a, m, c, vocab, a.device) for k, (m, c) in modes.items()}
        for k in modes:
            rows.append({"case": f"admission {k}", **adm[k]})
        base = adm["reserve"]
        for k in ("grow", "grow+cache"):
            rows.append({"case": f"admission {k} / reserve", "held_mean_x": adm[k]["held_mean"] / base["held_mean"],
                         "tokens_per_s_x": adm[k]["tokens_per_s"] / base["tokens_per_s"],
                         "tokens_per_cpu_s_x": adm[k]["tokens_per_cpu_s"] / base["tokens_per_cpu_s"],
                         "steps_x": base["steps"] / adm[k]["steps"], "target_x_ge": 2.0})

    for r in rows:
        print_table(r["case"], [{k: v for k, v in r.items() if k != "case"}])
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    notes = (f"{a.device} ({os.cpu_count()} cores, load average {load:.1f} at the end), random Qwen3 dims "
             f"'{a.dims}', an epoch every step ({'log on tmpfs' if a.log else 'no log'}); *_cpu_s: this "
             "process's CPU seconds (one torch thread on CPU), steadier than wall time on a shared machine"
             "; agent: isolated turns and all conversations at once; admission: Poisson arrivals, lognormal "
             "output lengths ended by the driver as an EOS would")
    path = write_results(a.name, rows, notes=notes, out_dir=a.out,
                         tag=None if a.device.startswith("cuda") else "cpu")
    import json

    extra = json.loads(path.read_text())
    extra.update(doc)
    path.write_text(json.dumps(extra, indent=1, default=str) + "\n")
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
