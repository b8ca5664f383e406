"""Serving engine: throughput with an epoch every step vs none, and recovery of in-flight requests vs re-prefill.

1. throughput: N concurrent greedy requests (prompt P, G new tokens each) through serve.Engine, once with no log
   and once with an epoch per step, interleaved rounds, same process. Output tokens/s over the decode steps,
   p50/p99 inter-token latency (decode step time), bytes per epoch.
2. recovery: 64 requests with ~2k-token prompts run a few decode steps with an epoch every step; the engine is
   closed (the log is what a SIGKILL would leave: every epoch is committed before its tokens are handed out);
   then, model loaded, (a) Engine.recover + one step = the first new token of every request, against (b) what a
   user can do today: a new engine re-prefilling prompt + tokens so far until every request has its next token.
   The bytes restored, GB/s reached, and the host-to-device bandwidth of pinned memory measured in the same run.

Decode steps run as CUDA graphs per batch bucket on a GPU (``--graphs auto``); a graph's capture happens at an
engine's first step of a bucket and is reported (``capture_s``), not counted in the step times.

    python benchmarks/bench_serve.py --out benchmarks/results            # H200, bf16, Qwen3-0.6B and 8B dims
    python benchmarks/bench_serve.py --concurrency 8,32 --new 32 --only throughput    # a reduced sweep
    python benchmarks/bench_serve.py --quick --device cpu                # a tiny model, to check the script
"""

from __future__ import annotations

import argparse
import gc
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


def qwen3(dims: str) -> Any:
    from transformers import Qwen3Config

    if dims == "0.6b":
        return Qwen3Config(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                           num_attention_heads=16, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True)
    if dims == "8b":
        return Qwen3Config(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                           num_attention_heads=32, num_key_value_heads=8, head_dim=128, tie_word_embeddings=False)
    if dims == "small":  # a CPU model whose KV rows are large enough (16 KiB in float32) for the log to matter
        return Qwen3Config(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                           num_attention_heads=4, num_key_value_heads=4, head_dim=128)
    return Qwen3Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16)  # "tiny"


def build(dims: str, device: str, dtype: torch.dtype) -> Any:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(qwen3(dims), dtype=dtype)
    return model.eval()


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def log_dir(need_bytes: int) -> tuple[Path, str]:
    shm = Path("/dev/shm")
    if shm.is_dir() and shutil.disk_usage(shm).free > 1.3 * need_bytes:
        return Path(tempfile.mkdtemp(prefix="cft-serve-", dir=shm)), "dram"
    return Path(tempfile.mkdtemp(prefix="cft-serve-")), "file"


def options(n: int, prompt: int, new: int, **kw: Any) -> dict[str, Any]:
    per = -(-(prompt + new) // 16)
    return {"num_blocks": n * per, "block_size": 16, "max_running": n, "max_waiting": n,
            "max_model_len": prompt + new, "max_batch_tokens": max(2048, min(8192, n * prompt)), **kw}


def prompts(n: int, length: int, vocab: int, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (length,), generator=g).tolist() for _ in range(n)]


# ------------------------------------------------------------------------------------------ throughput
# no log; an epoch per step through the Runtime (sync; async: written during the next step by its Python writer);
# the same two through step epochs (step_epochs="c": rows gathered on the device into a pinned ring, the GIL-free C
# writer commits; c-async: pipelined, up to async_depth steps held until their epochs committed). A mode may take
# suffixes: ":dN" (async_depth N), and, to attribute the cost only (the log is then WRONG; tokens are not
# affected), ":nogpu" (no gather or copy of the rows on the side stream) or ":nowriter" (no C writer); and
# ":nocompact" (the log never compacts: by default the engine compacts after twice its pool's bytes appended);
# ":tN": the C writer's copy + CRC threads (default min(12, cores - 4)); ":nofuse": the C writer copies each
# piece of a large payload whole, then checksums it (before: the bytes read twice from DRAM; default: fused in
# 256 KiB chunks); ":lazy": nothing prepared at construction (EngineOptions prepare_ahead=False: the log's next
# segment is then prepared beside the first steps, the pinned bulk buffer allocated by the first prefill).
EPOCHS = ("none", "sync", "async", "c", "c-async")
MODE_OPTIONS: dict[str, dict[str, Any]] = {
    "none": {"checkpoint": False}, "sync": {"step_epochs": "runtime"},
    "async": {"step_epochs": "runtime", "async_epochs": True},
    "c": {"step_epochs": "c"}, "c-async": {"step_epochs": "c", "async_epochs": True}}


def mode_options(mode: str) -> tuple[dict[str, Any], str]:
    """Engine options and the ablation (CONCORDIA_STEP_EPOCH_ABLATE) of a mode with its suffixes."""
    base, *sfx = mode.split(":")
    if base not in MODE_OPTIONS:
        raise ValueError(f"unknown mode {mode!r} (of {EPOCHS}, suffixes :dN :tN :nogpu :nowriter :nocompact "
                         ":nofuse :lazy)")
    opts, ablate = dict(MODE_OPTIONS[base]), ""
    for x in sfx:
        if x.startswith("d") and x[1:].isdigit():
            opts["async_depth"] = int(x[1:])
        elif x in ("nogpu", "nowriter") and base.startswith("c"):
            ablate = x[2:]
        elif x.startswith("t") and x[1:].isdigit() and base.startswith("c"):
            opts["_threads"] = x[1:]
        elif x == "nocompact" and base != "none":
            opts["_nocompact"] = True
        elif x == "nofuse" and base.startswith("c"):
            opts["_fuse"] = "0"
        elif x == "lazy" and base != "none":
            opts["prepare_ahead"] = False
        else:
            raise ValueError(f"unknown suffix {x!r} of mode {mode!r}")
    return opts, ablate


def run_batch(model: Any, device: str, n: int, prompt: int, new: int, epochs: str | bool,
              graphs: str = "auto") -> dict[str, Any]:
    """One engine, n requests submitted at once, stepped until idle. Per step() call its wall time (a decode
    step: every running request decodes one token, no graph captured); per request the times its tokens left
    the engine (committed). Whole-run throughput: every generated token over the wall time from the first
    step() to the last output, minus the graph captures (a one-off per engine and bucket, alike in every mode)."""
    epochs = {False: "none", True: "sync"}.get(epochs, epochs)  # type: ignore[call-overload]
    opts, ablate = mode_options(epochs)
    vocab = int(model.config.vocab_size)
    d, backend = log_dir(n * (prompt + new) * 200_000) if epochs != "none" else (None, "file")
    os.environ["CONCORDIA_STEP_EPOCH_ABLATE"] = ablate
    threads = opts.pop("_threads", None)
    if threads:
        os.environ["CONCORDIA_STEP_EPOCH_THREADS"] = threads
    nocompact = opts.pop("_nocompact", False)
    fuse = opts.pop("_fuse", None)
    if fuse is not None:
        os.environ["CONCORDIA_STEP_EPOCH_FUSE"] = fuse
    t_construct = time.perf_counter()
    try:
        eng = Engine(model, None if d is None else d / "log", options(n, prompt, new, backend=backend, graphs=graphs,
                                                                      **opts))
        if nocompact:  # the engine's own Runtime, but never compacting
            eng.runtime._compact_after = None
    finally:
        os.environ.pop("CONCORDIA_STEP_EPOCH_ABLATE", None)
        if threads:
            os.environ.pop("CONCORDIA_STEP_EPOCH_THREADS", None)
        os.environ.pop("CONCORDIA_STEP_EPOCH_FUSE", None)
    construct_s = time.perf_counter() - t_construct  # (the log's first segment and epoch: not in the run)
    reqs = [eng.submit(p, SamplingParams(max_new_tokens=new, temperature=0.0, ignore_eos=True))
            for p in prompts(n, prompt, vocab)]
    steps: list[float] = []
    nbytes: list[int] = []
    seen: dict[str, list[float]] = {r.id: [] for r in reqs}
    graph_steps = calls = 0
    captured = 0.0
    prefill_bytes = total_bytes = 0
    sync(device)
    t_start = time.perf_counter()
    while eng.has_work:
        c0 = eng.graphs.capture_s if eng.graphs is not None else 0.0
        decode = not eng.waiting and bool(eng.running) and all(
            len(r.ids) - r.n_computed == 1 for r in eng.running.values())
        t0 = time.perf_counter()
        out = eng.step()
        sync(device)
        t1 = time.perf_counter()
        calls += 1
        c1 = eng.graphs.capture_s if eng.graphs is not None else 0.0
        if c1 != c0:  # this step captured a bucket's graph: a one-off per engine and bucket, reported apart
            captured += c1 - c0
        elif decode:
            steps.append(t1 - t0)
        for rid, toks in out.new_tokens.items():
            seen[rid] += [t1 - captured] * len(toks)
        total_bytes += out.epoch_bytes
        if out.steps == 1 and out.new_tokens:
            if out.batch_tokens == len(out.new_tokens):
                nbytes.append(out.epoch_bytes)
                graph_steps += out.graph
            else:
                prefill_bytes += out.epoch_bytes
    t_end = time.perf_counter()
    fast = eng.fast
    tokens = [r.generated for r in reqs]  # ids are random
    eng.close()
    if d is not None:
        shutil.rmtree(d, ignore_errors=True)
    total = sum(len(t) for t in tokens)
    itl = [b - a for ts in seen.values() for a, b in zip(ts, ts[1:], strict=False)]
    ttft = [ts[0] - t_start for ts in seen.values() if ts]
    run_s = t_end - t_start - captured
    return {"tok_s_run": total / run_s, "run_s": run_s, "construct_s": construct_s, "step_p50_ms": 1e3 * median(steps),
            "step_p99_ms": 1e3 * percentile(steps, 99), "tok_s_decode": n * len(steps) / sum(steps),
            "itl_p50_ms": 1e3 * percentile(itl, 50), "itl_p99_ms": 1e3 * percentile(itl, 99),
            "ttft_p50_ms": 1e3 * median(ttft), "bytes_per_step": median(nbytes) if nbytes else 0,
            "prefill_epoch_bytes": prefill_bytes, "epoch_bytes_total": total_bytes, "decode_steps": len(steps), "step_calls": calls,
            "graph_steps": graph_steps, "capture_s": captured, "tokens": tokens,
            **({f"step_epoch_{k}_ms": 1e3 * v / max(1, fast.steps) for k, v in fast.t.items()} | {
                "step_epochs": fast.steps, "step_epoch_bulk": fast.bulk_steps, "step_epoch_rolls": fast.rolls,
                "step_epoch_fallbacks": fast.fallbacks, "step_epoch_send_deferred": fast.send_deferred,
                "step_epoch_largest_mb": fast.largest["bytes"] / 1e6,
                "step_epoch_largest_write_ms": fast.largest["write_ms"],
                "step_epoch_largest_commit_ms": fast.largest["commit_ms"]} if fast is not None else {})}


def bench_throughput(model: Any, device: str, concurrency: list[int], prompt: int, new: int,
                     rounds: int, graphs: str = "auto", modes: tuple[str, ...] = EPOCHS,
                     on_row: Any = None) -> list[dict[str, Any]]:
    """Medians over ``rounds`` rounds; each round runs every mode once, in an order rotated by the round (a
    noisy host, a warming cache or the pinned allocator hit every mode alike)."""
    run_batch(model, device, 2, 16, 4, False, graphs)  # warm up kernels
    rows = []
    for n in concurrency:
        got: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
        t0 = time.perf_counter()
        for i in range(rounds):
            for m in modes[i % len(modes):] + modes[: i % len(modes)]:
                got[m].append(run_batch(model, device, n, prompt, new, m, graphs))
        same = all(r["tokens"] == got["none"][0]["tokens"] for runs in got.values() for r in runs)
        med = {m: _med(got[m]) for m in modes}
        base = med["none"]
        row: dict[str, Any] = {"concurrent": n, "graphs": graphs}
        for m in modes:
            for k in ("tok_s_run", "run_s", "construct_s", "step_p50_ms", "step_p99_ms", "itl_p50_ms", "itl_p99_ms", "ttft_p50_ms",
                      "tok_s_decode"):
                row[f"{k}_{m}"] = med[m][k]
        for m in modes[1:]:
            row[f"cost_run_{m}_pct"] = 100 * (1 - med[m]["tok_s_run"] / base["tok_s_run"])
            row[f"cost_step_{m}_pct"] = 100 * (med[m]["step_p50_ms"] / base["step_p50_ms"] - 1)
            row[f"bytes_per_step_{m}"] = med[m]["bytes_per_step"]
            row[f"prefill_epoch_bytes_{m}"] = med[m]["prefill_epoch_bytes"]  # 0: it left merged with later steps
            row[f"epoch_bytes_total_{m}"] = med[m]["epoch_bytes_total"]
            row.update({f"{k}_{m}": v for k, v in med[m].items() if k.startswith("step_epoch")})
        row.update({"bytes_per_step": med[modes[-1]]["bytes_per_step"], "decode_steps": base["decode_steps"],
                    "graph_steps": base["graph_steps"], "capture_s": base["capture_s"],
                    "tokens_equal_all_runs": same, "rounds": rounds, "wall_s": time.perf_counter() - t0})
        rows.append(row)
        print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in rows[-1].items()}, flush=True)
        if on_row is not None:
            on_row(rows)
    return rows


def _med(runs: list[dict[str, Any]]) -> dict[str, Any]:
    return {k: median(r[k] for r in runs) for k in runs[0] if k != "tokens"}


# -------------------------------------------------------------------------------------------- recovery
def h2d_gbps(device: str, nbytes: int = 1 << 30) -> float:
    if not device.startswith("cuda"):
        return float("nan")
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst.copy_(src, non_blocking=True)
    sync(device)
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        sync(device)
        times.append(time.perf_counter() - t0)
    return nbytes / min(times) / 1e9


def _log_facts(log: Path) -> dict[str, Any]:
    files = [f for f in log.iterdir() if f.is_file()]
    base = [f for f in files if f.name.startswith("base.")]
    incr = [f for f in files if f.name.startswith("incr.")]
    return {"log_bytes": sum(f.stat().st_size for f in files), "base_segments": len(base),
            "base_bytes": sum(f.stat().st_size for f in base), "incr_segments": len(incr),
            "incr_bytes": sum(f.stat().st_size for f in incr)}


# how Engine.recover restores the pool: "streamed" (the default: streamed to the device through a pinned ring,
# the pool's checksums run by a CRC32C kernel on the bytes after each chunk's DMA, 16 copy threads, the first
# step's decode graph captured beside the restore), "streamed_host" (the session-6 default: the checksums on 8
# copy threads as they copy), "streamed_open" (every checksum at the log's open first: each byte read twice),
# "streamed_prefault" (+2 threads mapping the log's pages ahead of the copies), "streamed_r24" (a 24-slot
# ring), "streamed_s32" (32 MiB slots: half the chunks), "streamed_cold" (the graph captured at the first
# step, after the restore), "streamed_py" / "streamed_py_cold" (memcpy fills, the graph warm or cold),
# "streamed_pop" (8 threads populating the log's mappings during its open: RecoveryOptions.populate),
# "streamed_nt" (the fills write the ring with streaming stores: RecoveryOptions.nontemporal),
# "image" (a whole pinned host image, one DMA). ':N' after a mode sets the copy threads.
RECOVERY_MODES: dict[str, dict[str, Any]] = {
    "streamed": {"streamed": True},
    "streamed_host": {"streamed": True, "stream_verify": "host", "threads": 8},
    "streamed_open": {"streamed": True, "defer_verify": ()},
    "streamed_prefault": {"streamed": True, "prefault": 2},
    "streamed_r24": {"streamed": True, "ring_slots": 24},
    "streamed_s32": {"streamed": True, "slot_bytes": 32 << 20},
    "streamed_cold": {"streamed": True, "warm_graphs": False},
    "streamed_py": {"streamed": True, "nontemporal": False},
    "streamed_pop": {"streamed": True, "populate": 8},  # 8 populate threads in the open
    "streamed_py_cold": {"streamed": True, "warm_graphs": False},
    "streamed_nt": {"streamed": True, "nontemporal": True},
    # the first step's graph captured beside the restore after one eager warm-up forward, or none (the model ran
    # in this process before: what a server that warms its model up at load would do), instead of two
    "streamed_w1": {"streamed": True, "engine": {"capture_warmups": 1}},
    "streamed_w0": {"streamed": True, "engine": {"capture_warmups": 0}},
    # the pool DMA'd from the pinned log mirror (cuda/mirror.py) the writing engine kept (EngineOptions.mirror),
    # attached from its keeper on a helper thread started with the recovery (beside the log's open, timed)
    "streamed_mirror": {"streamed": True, "mirror": "attach"},
    "image": {"streamed": False, "defer_verify": ()},
}


def fork_log(src: Path, dst: Path) -> Path:
    """A copy of the log that a recovered engine may append to, leaving ``src`` as the crash left it: the
    segments are hard links except the last one (the one appended to), which is copied; the manifest is
    replaced by rename, never rewritten in place."""
    dst.mkdir(parents=True)
    segs = sorted(f.name for f in src.iterdir() if f.name.endswith(".cft"))
    for f in src.iterdir():
        if f.name == "LOCK" or not f.is_file():
            continue
        if f.name.endswith(".cft") and f.name != segs[-1]:
            os.link(f, dst / f.name)
        else:
            shutil.copy2(f, dst / f.name)
    return dst


def recover_once(log: Path, model: Any, device: str, backend: str, ref_pool: Any, n: int,
                 recovery: dict[str, Any], mirror_of: Path | None = None) -> tuple[dict[str, Any], dict[str, int]]:
    """Engine.recover (model loaded) + one step: every request's next token. Returns timings and the tokens.
    The recovered engine does not compact its log (a background compaction of the whole pool would run into the
    next measurement; it starts after the first step's epoch committed, so it never delays the first token)."""
    from concordia_ft.core.replay import flush_unmaps

    recovery = dict(recovery)
    warm = bool(recovery.pop("warm_graphs", True))
    engine_opts = {"backend": backend, **recovery.pop("engine", {})}
    # a restarted server starts with no mappings of an earlier open: the previous round's are unmapped now, not
    # by the background unmapper 2 s after its first token, inside this round's open (it holds the memory-map
    # lock the open's mappings and page faults wait for: session 13 measured opens of 0.08 s vs 0.3 s)
    flush_unmaps()
    t0 = time.perf_counter()
    if recovery.get("mirror") == "attach":  # the writer's mirror (its keeper follows the log it wrote)
        from concordia_ft.cuda.mirror import MirrorAttach

        assert mirror_of is not None
        recovery["mirror"] = MirrorAttach(mirror_of, torch.device(device).index or 0)
    rec = Engine.recover(log, model, engine_opts, recovery=recovery,
                         runtime_options={"compact_after_bytes": None}, warm_graphs=warm)
    sync(device)
    t_restored = time.perf_counter() - t0
    equal = bool(torch.equal(rec.pool.arena, ref_pool)) if ref_pool is not None else None
    cap0 = rec.graphs.capture_s if rec.graphs is not None else 0.0
    out = rec.step()
    sync(device)
    t_first = time.perf_counter() - t0
    capture = (rec.graphs.capture_s if rec.graphs is not None else 0.0) - cap0
    assert len(out.new_tokens) == n, f"{len(out.new_tokens)} of {n} requests got their next token"
    r = rec.recovered
    st = r.streamed.get("kv")
    row: dict[str, Any] = {
        "recover_s": t_restored, "first_token_all_s": t_first, "graph_capture_s": capture,
        "first_token_all_s_without_capture": t_first - capture,
        "verify_s": r.timings.verify_s, "verify_gb": r.timings.verify_bytes / 1e9, "verify_threads": r.timings.threads,
        "recover_into_s": r.seconds, "image_copy_s": r.timings.copy_s, "image_restore_s": r.restore_s,
        "pool_byte_equal": equal, **rec.recover_phases}
    if st is not None:
        row.update({"streamed_s": st.seconds, "streamed_gb": st.bytes / 1e9, "streamed_gbps": st.gbps,
                    "stream_plan_s": st.plan_s, "stream_fill_wait_s": st.fill_wait_s,
                    "stream_slot_wait_s": st.slot_wait_s, "stream_chunks": st.chunks,
                    "stream_direct_chunks": st.direct_chunks, "stream_threads": st.threads,
                    "stream_verified_gb": st.extra.get("verified_bytes", 0.0) / 1e9,
                    "stream_verify_combine_s": st.extra.get("verify_combine_s", 0.0), "stream_finish_s": st.finish_s,
                    "stream_sink_setup_s": st.extra.get("sink_setup_s", 0.0),
                    "stream_verify_on_device": bool(st.extra.get("verify_on_device", 0.0)),
                    "stream_device_crc_tiles": int(st.extra.get("device_crc_tiles", 0.0)),
                    "stream_c_loop": bool(st.extra.get("c_loop", 0.0)),
                    "stream_c_loop_failed": bool(st.extra.get("c_loop_failed", 0.0)),
                    "stream_put_s": st.extra.get("put_s", 0.0),
                    "open_populated_gb": st.extra.get("open_populated_bytes", 0.0) / 1e9,
                    "open_populate_s": st.extra.get("open_populate_s", 0.0),
                    "open_populate_pending": int(st.extra.get("open_populate_pending", 0.0)),
                    "stream_mirror_chunks": int(st.extra.get("mirror_chunks", 0.0)),
                    "stream_mirror_gb": st.extra.get("mirror_bytes", 0.0) / 1e9,
                    "stream_mirror_attach_s": st.extra.get("mirror_attach_s", 0.0),
                    "stream_mirror_fallback": bool(st.extra.get("mirror_fallback", 0.0)),
                    # the copy phase: the ring's loop (fills, DMAs, device checksums), without the plan
                    "copy_s": st.seconds - st.plan_s, "copy_gbps": st.bytes / max(1e-9, st.seconds - st.plan_s) / 1e9,
                    # end to end: the bytes moved over Engine.recover (open + engine + restore)
                    "e2e_gbps": st.bytes / t_restored / 1e9})
    first = {rid: t[0] for rid, t in out.new_tokens.items()}
    rec.close()
    del rec, r, st
    gc.collect()  # an engine and its graphs hold each other: free its pool now, not at the next collection
    return row, first


def _fresh_kernels() -> None:
    """Drop this process's loaded restore kernels (the CRC32C and page-scatter modules), so every recovery loads
    them as a restarted server does: from the NVRTC cache on disk, not from an earlier recovery in the process."""
    from concordia_ft.cuda import crc, streamed

    crc._loaded.clear()
    streamed._scatter.clear()


def _medians(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Per key, the median over the rounds of a number (bools and strings: the first round's value)."""
    out: dict[str, Any] = {}
    for k, v in rounds[0].items():
        vals = [r[k] for r in rounds if k in r]
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            vals = sorted(vals)
            m = len(vals)
            out[k] = vals[m // 2] if m % 2 else 0.5 * (vals[m // 2 - 1] + vals[m // 2])
        else:
            out[k] = v if all(x == v for x in vals) else vals
    return out


def bench_recovery(dims: str, device: str, dtype: torch.dtype, n: int, prompt: int, decoded: int,
                   h2d: float, *, modes: list[str], batch_tokens: int | None = None, compact: bool = True,
                   row: dict[str, Any] | None = None, progress: Any = None, rounds: int = 3) -> dict[str, Any]:
    """``row``: filled in as the run goes (``progress()`` after each part saves it), so a run cut short keeps
    what it measured. ``compact=False``: the writing engine's log never compacts (all incremental segments)."""
    t_start = time.perf_counter()
    model = build(dims, device, dtype)
    vocab = int(model.config.vocab_size)
    # budget: the requests prefilled first decode while the others prefill (16 steps of 8192 tokens for 64 x 2k),
    # and none may finish before the log is cut: all n must be in flight
    new = decoded + 64
    opts = options(n, prompt, new)
    if batch_tokens:
        opts["max_batch_tokens"] = batch_tokens
    probe = Engine(model, None, {**opts, "checkpoint": False})
    row_bytes, pool_bytes = probe.geo.row_bytes, probe.geo.nbytes
    del probe
    d, backend = log_dir((2.0 if compact else 1.15) * n * (prompt + new) * row_bytes)
    opts["backend"] = backend
    from concordia_ft.runtime import Runtime

    # the engine's own Runtime, but with compaction as asked (a background compaction rewrites the whole pool
    # every 256 MiB appended: the writer's cost, not the recovery's)
    rt = Runtime(str(d / "log"), fsync="never", backend=backend, on_compaction_error="warn",
                 **({} if compact else {"compact_after_bytes": None}))
    mirrored = any(m.partition(":")[0] == "streamed_mirror" for m in modes)
    eng = Engine(model, d / "log", {**opts, "mirror": mirrored}, _runtime=rt)
    ps = prompts(n, prompt, vocab)
    for p in ps:
        eng.submit(p, SamplingParams(max_new_tokens=new, temperature=0.0, ignore_eos=True))
    t0 = time.perf_counter()
    steps = 0
    while eng.waiting or min(len(r.generated) for r in eng.running.values()) < decoded:
        eng.step()
        steps += 1
    sync(device)
    write_s = time.perf_counter() - t0
    compactions = eng.runtime.last_compaction if eng.runtime is not None else None
    print(f"  recovery {dims}: {n} x {prompt} prompts + {decoded} tokens written with epochs in {write_s:.1f} s, "
          f"{steps} steps (+{time.perf_counter() - t_start:.1f} s)", flush=True)
    so_far = {r.id: list(r.ids) for r in eng.running.values()}
    assert len(so_far) == n, f"{n - len(so_far)} requests finished before the log was cut"
    ref_pool = eng.pool.arena  # the pool as the last committed epoch left it (kept for the byte comparison)
    mirror, eng.mirror = eng.mirror, None
    eng.close()  # every epoch committed
    if mirror is not None:  # as a server's follower would have by the time it died
        tm = time.perf_counter()
        caught = mirror.wait_caught_up(timeout_s=300.0)
        print(f"  recovery {dims}: pinned mirror {'caught up' if caught else 'NOT caught up'} "
              f"({mirror.mirrored_bytes / 1e9:.1f} GB, waited {time.perf_counter() - tm:.1f} s)", flush=True)
        row_mirror = {"mirror_caught_up": caught, "mirror_gb": mirror.mirrored_bytes / 1e9,
                      "mirror_wait_after_close_s": time.perf_counter() - tm}
        mirror.close()
    else:
        row_mirror = {}
    del eng
    facts = _log_facts(d / "log")
    print(f"  recovery {dims}: log {facts} (+{time.perf_counter() - t_start:.1f} s)", flush=True)
    body = sum(p.numel() for name, p in model.named_parameters() if "embed" not in name and "lm_head" not in name)
    row = {} if row is None else row
    progress = progress or (lambda: None)
    row.update({"dims": dims, "requests": n, "tokens_each": prompt + decoded, "row_kib": row_bytes / 1024,
                "flop_per_kv_byte": 2 * body / row_bytes,
                "pool_gb": pool_bytes / 1e9, "log_gb": facts["log_bytes"] / 1e9, **facts,
                "writer_compacts": compact, "last_compaction_epoch": getattr(compactions, "epoch", None),
                "max_batch_tokens": opts["max_batch_tokens"], "write_steps": steps,
                "prefill_with_epochs_s": write_s, "h2d_pinned_gbps": h2d, **row_mirror})
    base = Engine(model, None, {**opts, "checkpoint": False})
    ids = {}
    for rid, seq in so_far.items():
        ids[base.submit(seq, SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True)).id] = rid
    t0 = time.perf_counter()
    got_tok: dict[str, int] = {}
    while len(got_tok) < n:
        o = base.step()
        for bid, t in o.new_tokens.items():
            got_tok.setdefault(ids[bid], t[0])
    sync(device)
    t_reprefill = time.perf_counter() - t0
    row["reprefill_first_token_all_s"] = t_reprefill
    row["reprefill_tokens"] = sum(len(s) for s in so_far.values())
    print(f"  recovery {dims}: re-prefill of {row['reprefill_tokens']} tokens until every request's next token: "
          f"{t_reprefill:.2f} s (+{time.perf_counter() - t_start:.1f} s)", flush=True)
    del base
    torch.cuda.empty_cache() if device.startswith("cuda") else None
    progress()
    firsts: dict[str, dict[str, int]] = {}
    per_round: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
    row["recovery_rounds"] = rounds
    row["recovery_order"] = []
    forks = 0
    for rnd in range(rounds):
        # modes rotated per round: in every earlier run the mode measured first was the slowest (6 of 6 pairs), so
        # each mode takes each place in turn and the rows hold medians over the rounds (and every round's value)
        order = modes[rnd % len(modes):] + modes[:rnd % len(modes)]
        row["recovery_order"].append(order)
        for mode in order:
            name, _, threads = mode.partition(":")
            recovery: dict[str, Any] = dict(RECOVERY_MODES[name])
            if threads:
                recovery["threads"] = int(threads)
            fork = fork_log(d / "log", d / f"fork-{forks}")
            forks += 1
            _fresh_kernels()
            got, tokens = recover_once(fork, model, device, backend, ref_pool, n, recovery, mirror_of=d / "log")
            shutil.rmtree(fork, ignore_errors=True)
            if mode in firsts and tokens != firsts[mode]:
                raise AssertionError(f"recovery {dims} [{mode}]: round {rnd + 1} gave other next tokens than round 1")
            firsts.setdefault(mode, tokens)
            got["round"], got["place"] = rnd, order.index(mode)
            per_round[mode].append(got)
            row.update({f"{mode}.{k}": v for k, v in _medians(per_round[mode]).items()})
            for k in ("first_token_all_s", "recover_s", "open_s", "streamed_s", "copy_gbps", "e2e_gbps"):
                if k in got:
                    row[f"{mode}.rounds.{k}"] = [g[k] for g in per_round[mode]]
            row[f"{mode}.rounds.place"] = [g["place"] for g in per_round[mode]]
            row[f"{mode}.speedup"] = t_reprefill / row[f"{mode}.first_token_all_s"]
            row[f"{mode}.restore_gbps"] = pool_bytes / row[f"{mode}.recover_s"] / 1e9
            progress()
            short = {"recover_s": "rec", "first_token_all_s": "first", "graph_capture_s": "cap", "open_s": "open",
                     "construct_s": "constr", "load_s": "load", "verify_s": "verify", "streamed_s": "stream",
                     "streamed_gbps": "GB/s", "stream_plan_s": "plan", "stream_fill_wait_s": "fillw",
                     "stream_slot_wait_s": "slotw", "stream_finish_s": "fin", "stream_verify_combine_s": "comb",
                     "stream_verified_gb": "vGB", "stream_direct_chunks": "direct", "stream_chunks": "chunks", "stream_sink_setup_s": "ring", "open_populated_gb": "popGB",
                     "image_copy_s": "icopy", "image_restore_s": "irest", "pool_byte_equal": "equal",
                     "copy_gbps": "copyGB/s", "e2e_gbps": "e2eGB/s", "warm_capture_s": "wcap",
                     "capture_wait_s": "capw", "stream_verify_on_device": "dev",
                     "stream_c_loop": "C", "stream_c_loop_failed": "Cfail", "stream_put_s": "put",
                     "stream_mirror_chunks": "mirch", "stream_mirror_gb": "mirGB", "stream_mirror_attach_s": "mirat",
                     "stream_mirror_fallback": "mirfb"}
            brief = {short[k]: round(v, 3) if isinstance(v, float) else v for k, v in got.items() if k in short}
            print(f"  recovery {dims} [{mode}] round {rnd + 1}: {brief} (+{time.perf_counter() - t_start:.1f} s)",
                  flush=True)
            torch.cuda.empty_cache() if device.startswith("cuda") else None
    del ref_pool
    if mirrored:
        from concordia_ft.core.keeper import stop_keeper

        stop_keeper(d / "log")  # the mirror's pinned memory is freed with its keeper
    shutil.rmtree(d, ignore_errors=True)
    torch.cuda.empty_cache() if device.startswith("cuda") else None
    for mode, first in firsts.items():
        row[f"{mode}.speedup"] = t_reprefill / row[f"{mode}.first_token_all_s"]
        row[f"{mode}.restore_gbps"] = pool_bytes / row[f"{mode}.recover_s"] / 1e9
        row[f"{mode}.same_next_token_as_reprefill"] = f"{sum(first[k] == got_tok[k] for k in first)}/{n}"
    if len(firsts) > 1:
        a, b = list(firsts.values())[:2]
        row["same_next_token_across_modes"] = f"{sum(a[k] == b[k] for k in a)}/{n}"
    del model
    torch.cuda.empty_cache() if device.startswith("cuda") else None
    row["wall_s"] = time.perf_counter() - t_start
    print(f"SUMMARY {dims}: pool {pool_bytes / 1e9:.1f} GB, re-prefill {t_reprefill:.3f} s; " + "; ".join(
        f"{m}: restored {row[f'{m}.recover_s']:.3f} s, first token {row[f'{m}.first_token_all_s']:.3f} s "
        f"(capture at the step {row[f'{m}.graph_capture_s']:.3f}, beside the restore "
        f"{row.get(f'{m}.warm_capture_s', 0.0):.3f}), x{row[f'{m}.speedup']:.2f}, "
        f"{row[f'{m}.restore_gbps']:.1f} GB/s end to end, copy {row.get(f'{m}.copy_gbps', float('nan')):.1f} GB/s, "
        f"equal={row[f'{m}.pool_byte_equal']}" for m in firsts), flush=True)
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--quick", action="store_true", help="a tiny model and small sizes: checks the script")
    ap.add_argument("--only", default="throughput,recovery")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--recovery-dims", default="0.6b,8b")
    ap.add_argument("--recovery-rounds", type=int, default=3,
                    help="recoveries per mode, the modes rotated per round (medians reported)")
    ap.add_argument("--concurrency", default=None, help="comma-separated (default 1,8,32,64)")
    ap.add_argument("--prompt", type=int, default=None, help="throughput prompt tokens (default 128)")
    ap.add_argument("--new", type=int, default=None, help="throughput new tokens each (default 128)")
    ap.add_argument("--graphs", default="auto", help="engine decode graphs: auto, on, padded, off")
    ap.add_argument("--eager-concurrency", default="",
                    help="also run these concurrencies with graphs off (the eager step, for comparison)")
    ap.add_argument("--recovery-requests", type=int, default=64)
    ap.add_argument("--recovery-prompt", type=int, default=2000)
    ap.add_argument("--recovery-modes", default="streamed",
                    help="comma-separated, of RECOVERY_MODES (streamed, streamed_host, streamed_open, "
                         "streamed_prefault, streamed_r24, streamed_s32, streamed_cold, streamed_py, streamed_py_cold, streamed_pop, streamed_nt, image); ':N' sets the copy threads, "
                         "e.g. streamed:8")
    ap.add_argument("--image-dims", default="", help="dims that also run the image path (e.g. 0.6b)")
    ap.add_argument("--build-batch-tokens", type=int, default=None,
                    help="max_batch_tokens of the engine that writes the recovery log (larger prefill chunks)")
    ap.add_argument("--no-build-compaction", action="store_true",
                    help="the engine that writes the recovery log never compacts it (saves its background rewrites)")
    ap.add_argument("--tag", default=None)
    ap.add_argument("--modes", default=",".join(EPOCHS), help=f"epoch modes, 'none' first (of {EPOCHS})")
    a = ap.parse_args()
    dtype = torch.bfloat16 if a.device.startswith("cuda") else torch.float32
    parts = set(a.only.split(","))
    thr: list[dict[str, Any]] = []
    recs: list[dict[str, Any]] = []
    notes = ("throughput: greedy, prompt {p} + {g} new tokens each, all requests submitted at once; tok_s_run = "
             "every generated token over the whole run (first step to last output, prefill and its epoch "
             "included, graph captures excluded); step_p50/p99 = decode steps (every request decoding, the "
             "steady state); itl = per request, the gaps between the times its tokens left the engine; medians "
             "over rounds, modes interleaved and rotated per round; 'none' = no log (baseline), "
             "'sync' = one committed epoch per engine step, "
             "'async' = the same epochs, each written while the next step computes (a step's tokens are handed out "
             "once its epoch committed, one step later); 'c' / 'c-async' = the same two through step epochs "
             "(step_epochs='c': the step's rows gathered on the device into a pinned ring (a prefill: a pinned bulk "
             "buffer), the epoch laid out, checksummed and committed by "
             "the GIL-free C writer). recovery: model loaded; recover_s = Engine.recover "
             "(replay + verify + restore), first_token_all_s = + one step giving every request its next token; "
             "reprefill = a new engine prefilling prompt + tokens so far (what a user can do today).")
    p, g = (32, 16) if a.quick else (128, 128)
    p, g = a.prompt or p, a.new or g
    conc = [1, 4] if a.quick else [1, 8, 32, 64]
    if a.concurrency:
        conc = [int(x) for x in a.concurrency.split(",")]
    eager = [int(x) for x in a.eager_concurrency.split(",") if x]
    modes = tuple(a.modes.split(","))
    try:
        for m in modes:
            mode_options(m)
    except ValueError as e:
        ap.error(str(e))
    if modes[0] != "none":
        ap.error(f"--modes must start with 'none' (of {EPOCHS})")

    def save(quiet: bool = True) -> None:
        path = write_results("serve", thr + recs, baseline=[], notes=notes.format(p=p, g=g), out_dir=a.out,
                             tag=a.tag or ("cpu-quick" if a.quick else None))
        if not quiet:
            print(f"wrote {path}", flush=True)

    if "throughput" in parts:
        dims = "tiny" if a.quick else "0.6b"
        model = build(dims, a.device, dtype)
        rounds = 1 if a.quick else a.rounds
        def partial(rows: list[dict[str, Any]]) -> None:  # a run cut short still leaves the rows it finished
            nonlocal thr
            thr = [{"part": "throughput", "dims": dims, **r} for r in rows]
            save()

        thr = [{"part": "throughput", "dims": dims, **r}
               for r in bench_throughput(model, a.device, conc, p, g, rounds, a.graphs, modes, partial)]
        if eager:
            thr += [{"part": "throughput", "dims": dims, **r}
                    for r in bench_throughput(model, a.device, eager, p, g, rounds, "off", modes)]
        del model
        save()
    if "recovery" in parts:
        h2d = h2d_gbps(a.device)
        for dims in (["tiny"] if a.quick else a.recovery_dims.split(",")):
            n, prompt = (8, 64) if a.quick else (a.recovery_requests, a.recovery_prompt)
            modes = a.recovery_modes.split(",") + (["image"] if dims in a.image_dims.split(",") else [])
            recs.append({"part": "recovery"})
            bench_recovery(dims, a.device, dtype, n, prompt, 8, h2d, modes=modes, batch_tokens=a.build_batch_tokens,
                           compact=not a.no_build_compaction, row=recs[-1], progress=save,
                           rounds=1 if a.quick else a.recovery_rounds)
            save()
    if len(recs) >= 2 and all("streamed.speedup" in r for r in recs[:2]):
        import math

        (x0, s0), (x1, s1) = [(r["flop_per_kv_byte"], r["streamed.speedup"]) for r in recs[:2]]
        if x0 != x1 and s0 > 0 and s1 > 0:  # speedup ~ a power of the model's FLOP per byte of KV it restores
            k = (math.log(s1) - math.log(s0)) / (math.log(x1) - math.log(x0))
            cross = x0 * math.exp(-math.log(s0) / k) if k else float("nan")
            for r in recs:
                r["crossover_flop_per_kv_byte_estimate"] = cross
            print(f"crossover (restore = re-prefill), interpolated from the two dims: {cross:.0f} FLOP per KV byte "
                  f"({recs[0]['dims']}: {x0:.0f}, {recs[1]['dims']}: {x1:.0f})", flush=True)
            save()
    if thr:
        print_table("serve throughput: epoch every step vs none", thr,
                    ["concurrent", "tok_s_run_none", "step_p50_ms_none"] + [k for m in modes[1:] for k in (
                        f"cost_run_{m}_pct", f"cost_step_{m}_pct")] + ["bytes_per_step"])
        print_table("serve inter-token latency (ms, per request, as tokens leave the engine)", thr,
                    ["concurrent"] + [k for m in modes for k in (f"itl_p50_ms_{m}", f"itl_p99_ms_{m}")])
    if recs:
        m0 = a.recovery_modes.split(",")[0]
        print_table("serve recovery: restore vs re-prefill (model loaded)", recs,
                    ["dims", "requests", "tokens_each", "log_gb", f"{m0}.recover_s", f"{m0}.first_token_all_s",
                     "reprefill_first_token_all_s", f"{m0}.speedup", f"{m0}.restore_gbps", "h2d_pinned_gbps",
                     f"{m0}.pool_byte_equal"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
