"""LLM sessions on one GPU: decode with a checkpoint every token, base snapshots, 2k-token recovery, LoRA SFT.

Random weights (values do not change speed), bf16:
- decode: Qwen3-0.6B dimensions; tokens/s with a checkpoint EVERY token vs none (same process, interleaved
  runs, same decode loop), plus plain ``model.generate()`` for reference; dirty pages/bytes of the first epoch
  and per token.
- base snapshot: the first epoch with and without the weights registered immutable.
- recovery: a 2k-token session (2000-token prompt + 24 generated tokens, a checkpoint per token) is abandoned
  mid-answer; time for Session.recover (log verify + copy + restore into a fresh GPU arena) + the first new
  token (decode + its epoch), the model already loaded and warmed by one decode on a throwaway cache of the same
  shape before each timer (same process: the fresh-process path is tested on CPU in tests/test_session.py);
  the new path and the baseline (serial checksums, pageable images) interleaved in one run.
- LoRA SFT: Qwen2.5-0.5B dimensions, r=8 on every attention and MLP projection, AdamW; interleaved rounds of
  steps with no checkpoint, sync epochs and async epochs (checkpoint_async): the step delta (the checkpoint
  call's time on the training thread, and whole-step wall time and steps/s against no checkpoint), the async
  commit latency (call -> durable), whether backpressure ever held a step, the device snapshot's size; sync
  epochs through the CUDA handlers vs the CPU path (sync + DtoH into pinned host mirrors + CPU dense
  trackers); dirty pages vs total pages (weights registered immutable). On a CPU, --quick shrinks the model
  to 2 layers (the code path, not a speed claim).

Usage: python benchmarks/bench_llm.py [--out DIR] [--quick] [--device cuda|cpu] [--only decode,base,recovery,lora]
"""

from __future__ import annotations

import argparse
import inspect
import os
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch  # noqa: E402
from benchreport import median, percentile, print_table, write_results  # noqa: E402

RT_OPTS = {"compact_after_bytes": None}  # no background compaction while timing
LORA_ROUNDS = 3
LORA_STEPS = 8


def qwen3_06b():
    from transformers import Qwen3Config

    return Qwen3Config(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                       tie_word_embeddings=True, rope_theta=1_000_000.0)


def qwen25_05b():
    from transformers import Qwen2Config

    return Qwen2Config(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                       num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
                       tie_word_embeddings=True, rope_theta=1_000_000.0)


def build(cfg: Any, device: str, dtype: torch.dtype = torch.bfloat16) -> Any:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    return model.eval()


def log_place(work: Path, need_bytes: int) -> tuple[Path, str]:
    shm = Path("/dev/shm")
    if shm.is_dir() and shutil.disk_usage(shm).free > 2 * need_bytes:
        return Path(tempfile.mkdtemp(prefix="cft-bench-", dir=shm)), "dram"
    return Path(tempfile.mkdtemp(prefix="cft-bench-", dir=work)), "file"


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


# ---------------------------------------------------------------------------------------------- decode
def decode_run(model: Any, log_root: Path, backend: str, every: int, prompt: torch.Tensor, new: int,
               device: str, durability: str = "durable") -> dict[str, Any]:
    from concordia_ft.session import Session

    stamps: list[float] = []
    d = Path(tempfile.mkdtemp(dir=log_root))
    s = Session(model, d / "log", checkpoint_every=every, max_cache_len=prompt.shape[1] + new + 8,
                backend=backend, runtime_options=RT_OPTS, durability=durability)
    try:
        s.generate(prompt, max_new_tokens=new, eos_token_ids=(), on_token=lambda t: stamps.append(time.perf_counter()))
        sync(device)
        gaps = [b - a for a, b in zip(stamps, stamps[1:], strict=False)]
        st = s.stats
        return {"ms_per_token": 1e3 * median(gaps), "tokens_per_s": 1.0 / median(gaps),
                "first_epoch_pages": st.epoch_pages[0], "first_epoch_bytes": st.epoch_bytes[0],
                "token_epoch_pages": median(st.epoch_pages[2:]) if len(st.epoch_pages) > 3 else None,
                "token_epoch_bytes": median(st.epoch_bytes[2:]) if len(st.epoch_bytes) > 3 else None,
                "checkpoint_ms": 1e3 * median(st.checkpoint_s[2:]) if len(st.checkpoint_s) > 3 else None,
                "detect_ms": 1e3 * median(st.detect_s[2:]) if len(st.detect_s) > 3 else None,
                "append_ms": 1e3 * median(st.append_s[2:]) if len(st.append_s) > 3 else None,
                "full_bytes": st.epoch_full_bytes[-1], "tokens": s.ids[prompt.shape[1]:]}
    finally:
        s.close()
        shutil.rmtree(d, ignore_errors=True)


def bench_decode(model: Any, log_root: Path, backend: str, device: str, quick: bool) -> list[dict[str, Any]]:
    new = 16 if quick else 64
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, model.config.vocab_size, (1, 128), generator=g)
    decode_run(model, log_root, backend, 1, prompt, 8, device)  # warm-up (kernels, handler module load)
    decode_run(model, log_root, backend, 1, prompt, 8, device, durability="pipelined")
    runs: dict[str, list[dict[str, Any]]] = {"none": [], "every": [], "every_async": []}
    for _ in range(1 if quick else 5):  # interleaved: the host's clock drifts over a run
        runs["none"].append(decode_run(model, log_root, backend, 10**9, prompt, new, device))
        runs["every"].append(decode_run(model, log_root, backend, 1, prompt, new, device))
        runs["every_async"].append(decode_run(model, log_root, backend, 1, prompt, new, device,
                                              durability="pipelined"))
    assert all(r["tokens"] == runs["none"][0]["tokens"] for rs in runs.values() for r in rs), "tokens differ"
    # plain generate() (DynamicCache, its own loop) for reference
    ids = prompt.to(device)
    model.generate(ids, max_new_tokens=8, do_sample=False, eos_token_id=None)
    sync(device)
    t0 = time.perf_counter()
    model.generate(ids, max_new_tokens=new, do_sample=False, eos_token_id=None)
    sync(device)
    gen_tps = new / (time.perf_counter() - t0)
    none_ms = median(r["ms_per_token"] for r in runs["none"])
    every_ms = median(r["ms_per_token"] for r in runs["every"])
    async_ms = median(r["ms_per_token"] for r in runs["every_async"])
    e = runs["every"][-1]
    ea = runs["every_async"][-1]
    return [{
        "case": "decode qwen3-0.6b bf16", "tokens": new, "log_backend": backend,
        "tok_s_no_ckpt": 1e3 / none_ms, "tok_s_ckpt_every_token": 1e3 / every_ms,
        "overhead_pct": 100.0 * (every_ms / none_ms - 1.0), "checkpoint_ms": e["checkpoint_ms"],
        "tok_s_ckpt_every_token_async": 1e3 / async_ms, "overhead_pct_async": 100.0 * (async_ms / none_ms - 1.0),
        "checkpoint_call_ms_async": ea["checkpoint_ms"],
        "detect_ms": e["detect_ms"], "append_ms": e["append_ms"],
        "first_epoch_pages": e["first_epoch_pages"], "first_epoch_bytes": e["first_epoch_bytes"],
        "token_epoch_pages": e["token_epoch_pages"], "token_epoch_bytes": e["token_epoch_bytes"],
        "full_bytes": e["full_bytes"], "reduction_x": e["full_bytes"] / max(1, e["token_epoch_bytes"] or 1),
        "generate_tok_s": gen_tps, "runs_ms_none": [r["ms_per_token"] for r in runs["none"]],
        "runs_ms_every": [r["ms_per_token"] for r in runs["every"]],
        "runs_ms_every_async": [r["ms_per_token"] for r in runs["every_async"]],
    }]


# ------------------------------------------------------------------------------------------ base snapshot
def bench_base(model: Any, log_root: Path, backend: str, device: str) -> list[dict[str, Any]]:
    from concordia_ft.session import Session

    rows = []
    for with_weights in (False, True):
        d = Path(tempfile.mkdtemp(dir=log_root))
        s = Session(model, d / "log", max_cache_len=256, backend=backend, log_weights=with_weights,
                    runtime_options=RT_OPTS)
        try:
            sync(device)
            t0 = time.perf_counter()
            s.checkpoint()
            dt = time.perf_counter() - t0
            st = s.runtime.last_stats
            rows.append({"case": f"base snapshot {'with' if with_weights else 'without'} immutable weights",
                         "seconds": dt, "pages": st.pages, "bytes": st.total_bytes,
                         "weights_bytes": sum(p.numel() * p.element_size() for p in model.parameters())})
            if with_weights:  # immutable: the next epoch logs none of them
                s.checkpoint()
                rows[-1]["next_epoch_pages"] = s.runtime.last_stats.pages
        finally:
            s.close()
            shutil.rmtree(d, ignore_errors=True)
    return rows


# ---------------------------------------------------------------------------------------------- recovery
class _Abandon(Exception):
    pass


# the path before parallel verification and pinned images: payload checksums one after another on one thread,
# images in pageable memory (the driver stages the copy to the GPU). Copies still run on threads, and the
# restore is the contiguous copy of this version (the old one copied into a temporary and scattered pages);
# the session-level changes (no zero check, no zeroed arena, in-place host regions) apply to both.
BASELINE_RECOVERY = {"parallel_verify": False, "pinned": False}


def _warm_decode(model: Any, device: str, max_cache_len: int, lengths: list[int]) -> None:
    """The serving process is warm before it takes the session over: one decode step on a THROWAWAY cache of
    the same shape (same context length, so the same attention kernels), nothing from the log."""
    from concordia_ft.integrations.transformers import ArenaKVCache
    from concordia_ft.session import sdpa_backends

    p = next(model.parameters())
    cache = ArenaKVCache(model.config, max_cache_len, dtype=p.dtype, device=device)
    cache.set_lengths(lengths)
    kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    with torch.inference_mode(), sdpa_backends("reproducible", device):  # the kernels the Session's steps use
        model(input_ids=torch.zeros((1, 1), dtype=torch.long, device=device), use_cache=True, logits_to_keep=1,
              **{kw: cache})
    sync(device)
    del cache


OLD_SEGMENTS = {"mapped_segment_bytes": 64 << 20}  # the log's default, a Session's before SESSION_MAPPED_SEGMENT_BYTES
RECOVERY_MODES = {
    # the path measured last session (176 ms at 6b9add9): a log of 64 MiB mapped segments, checksums at the log's
    # open, the first token from one eager decode step (the graph captured before the second)
    "today": {"recovery": {"defer_verify": ()}, "standby": False, "write_log_options": OLD_SEGMENTS,
              "log_options": OLD_SEGMENTS},
    # the Session defaults: a Standby made before the timer (arena allocated, decode graph captured, restore
    # memory cached: reported apart), 8 MiB segments, the KV checksums run while the streamed restore copies
    "standby": {"recovery": {}, "standby": True},
    # the same, every checksum at the open (to choose the default by measurement)
    "standby_verify_at_open": {"recovery": {"defer_verify": ()}, "standby": True},
    # the same standby on a log of 64 MiB segments: what the segment size costs the open
    "standby_64mib_log": {"recovery": {}, "standby": True, "write_log_options": OLD_SEGMENTS,
                          "log_options": OLD_SEGMENTS},
    # the standby with 16 replay / restore threads (the H200 host has 16 cores; the default is min(8, CPUs))
    "standby_16_threads": {"recovery": {"threads": 16}, "standby": True},
    # the standby with the log's segments reopened as plain files (no mapped tail to fault in and register with
    # the driver, no spare prepared beside the restore)
    "standby_file_log": {"recovery": {}, "standby": True, "log_options": {"mapped": "off"}},
    # before parallel checksums and pinned images (session 5's baseline)
    "baseline": {"recovery": {**BASELINE_RECOVERY, "defer_verify": ()}, "standby": False,
                 "write_log_options": OLD_SEGMENTS, "log_options": OLD_SEGMENTS},
}


def _recover_once(model: Any, log: Path, backend: str, device: str, mode: dict[str, Any], max_len: int,
                  check: Any = None, profile: Path | None = None) -> dict[str, Any]:
    """One timed recovery + first token. ``check(session)``, when given, runs between the two, and that
    recovery's first-token time is then not meaningful (the caller does not time it)."""
    import gc

    from concordia_ft.session import Session, Standby

    gc.collect()  # the previous recovery's session (reference cycles) gives its arena and pinned images back first
    standby = None
    capture_ms = setup_ms = None
    if mode["standby"]:  # warm-up, before the timer (a serving engine captures its graphs at start)
        standby = Standby(model, max_cache_len=max_len)
        setup_ms = 1e3 * standby.setup_s
        capture_ms = 1e3 * standby.capture_s if standby.decoder is not None else None
    sync(device)
    prof = None
    if profile is not None:
        import cProfile

        prof = cProfile.Profile()
        prof.enable()
    t0 = time.perf_counter()
    rt_opts: dict[str, Any] = {**RT_OPTS, "recovery": mode["recovery"]}
    if mode.get("log_options"):
        rt_opts["log_options"] = mode["log_options"]
    r = Session.recover(log, model, backend=backend, runtime_options=rt_opts, standby=standby)
    t1 = time.perf_counter()
    if check is not None:
        check(r)
    first: list[float] = []

    def first_token(tok: int) -> None:  # the token is on the host (read after its step): no device sync, which
        first.append(time.perf_counter())  # would also wait for the graph replay queued behind it
        raise _Abandon

    if check is None:
        try:
            r.resume(on_token=first_token)  # decode one token, commit its epoch, then on_token
        except _Abandon:
            pass
    else:
        first.append(time.perf_counter())
    if prof is not None:
        prof.disable()
        import io
        import pstats

        buf = io.StringIO()
        st = pstats.Stats(prof, stream=buf)
        st.sort_stats("cumulative").print_stats(60)
        st.sort_stats("tottime").print_stats(30)
        profile.write_text(buf.getvalue())
    tm = r.recovered.timings
    graph = r._graph is not None and r._graph.stats.epochs > 0
    ph = r.recovery_phases
    out = {"recover_ms": 1e3 * (t1 - t0), "verify_ms": 1e3 * tm.verify_s, "copy_ms": 1e3 * tm.copy_s,
           "restore_ms": 1e3 * r.recovered.restore_s, "first_token_ms": 1e3 * (first[0] - t1),
           "total_ms": 1e3 * (first[0] - t0), "verify_bytes": tm.verify_bytes, "copy_bytes": tm.copy_bytes,
           "threads": tm.threads, "ids": r.ids, "first_token_graph": graph,
           "open_ms": 1e3 * ph["open_s"], "construct_ms": 1e3 * ph["construct_s"], "load_ms": 1e3 * ph["load_s"],
           "recover_into_ms": 1e3 * ph["recover_into_s"], "check_ms": 1e3 * ph["check_s"],
           "standby_capture_ms": capture_ms, "standby_setup_ms": setup_ms}
    st = ph.get("streamed.kv")
    if st is not None:
        out.update({"stream_ms": 1e3 * st["seconds"], "stream_fill_wait_ms": 1e3 * st["fill_wait_s"],
                    "stream_setup_ms": 1e3 * st.get("sink_setup_s", 0.0), "stream_plan_ms": 1e3 * st["plan_s"],
                    "stream_verified_bytes": st.get("verified_bytes", 0.0), "stream_bytes": st["bytes"]})
    if check is None:
        if graph:
            gs = r._graph.stats
            out["decode_step_ms"] = 1e3 * gs.token_s[0] if gs.token_s else None
            out["checkpoint_ms"] = 1e3 * gs.commit_s[0] if gs.commit_s else None
        else:
            out["decode_step_ms"] = 1e3 * r.stats.step_s[-1]
            out["checkpoint_ms"] = 1e3 * r.stats.checkpoint_s[-1]
    # open = verify + the rest of the log's open (segments reopened, the writer's tail mapped); the rest of
    # recover: fingerprint + geometry checks, the Session object (arena, registration), recover_into
    out["other_ms"] = out["recover_ms"] - out["verify_ms"] - out["copy_ms"] - out["restore_ms"] - out.get(
        "stream_ms", 0.0)
    if check is not None:
        out["session"] = r  # the caller resumes it to the end and closes it
    else:
        r.close()
    return out


def bench_recovery(model: Any, log_root: Path, backend: str, device: str, quick: bool,
                   threads: int | None = None, reps: int | None = None, modes: tuple[str, ...] | None = None,
                   profile_dir: Path | None = None) -> list[dict[str, Any]]:
    """A 2k-token session abandoned mid-answer, recovered ``reps`` times by each mode (RECOVERY_MODES),
    interleaved in one process. The first recovery of the process is reported apart (it also pins the image
    memory / the ring: torch's pinned cache then reuses it). After the timed reps, one untimed recovery per
    mode checks the state byte for byte and resumes to the end: the tokens must equal an uninterrupted run's."""
    from concordia_ft.core.replay import replay
    from concordia_ft.session import Session

    modes = modes or ("today", "standby", "standby_verify_at_open", "standby_64mib_log")
    n_prompt, n_new = (1000, 24) if quick else (2000, 48)
    reps = reps or (2 if quick else 6)
    g = torch.Generator().manual_seed(2)
    prompt = torch.randint(0, model.config.vocab_size, (1, n_prompt), generator=g)
    d = Path(tempfile.mkdtemp(dir=log_root))
    max_len = n_prompt + n_new + 16
    # the uninterrupted run (graph decode, as the recovered sessions continue)
    ref = Session(model, d / "ref", max_cache_len=max_len, backend=backend, runtime_options=RT_OPTS)
    want = ref.generate(prompt, max_new_tokens=n_new, eos_token_ids=())
    ref.close()
    shutil.rmtree(d / "ref", ignore_errors=True)
    logs: dict[str, dict[str, Any]] = {}  # per write options: the abandoned log and the live state it must give

    def write(key: str, log_options: dict[str, Any]) -> dict[str, Any]:
        log = d / f"log-{key}"
        opts = {**RT_OPTS, "log_options": log_options} if log_options else RT_OPTS
        s = Session(model, log, max_cache_len=max_len, backend=backend, runtime_options=opts)
        count = [0]

        def stop_at_half(tok: int) -> None:
            count[0] += 1
            if count[0] == n_new // 2:
                raise _Abandon  # the process "dies" here: nothing more is written

        try:
            s.generate(prompt, max_new_tokens=n_new, eos_token_ids=(), on_token=stop_at_half)
        except _Abandon:
            pass
        live = {"log": log, "arena": s.cache.arena.clone(), "ids": s.ids, "lengths": s.cache.lengths()}
        s.close()
        live["log_bytes"] = sum(f.stat().st_size for f in log.rglob("*") if f.is_file())
        live["segments"] = sorted(f.name for f in log.iterdir() if f.suffix == ".cft")
        probe = replay(log, materialize=False, collect_summaries=True)
        live["epochs"] = len(probe.epochs)
        probe.close()
        return live

    for name in modes:
        wo = RECOVERY_MODES[name].get("write_log_options") or {}
        key = "-".join(f"{k}={v}" for k, v in sorted(wo.items())) or "default"
        if key not in logs:
            logs[key] = write(key, wo)
        RECOVERY_MODES[name]["_log"] = key
    lengths = next(iter(logs.values()))["lengths"]
    checks: dict[str, Any] = {}

    def check(r: Any, name: str = "") -> None:  # the recovered state, byte for byte, before any new token
        live = logs[RECOVERY_MODES[name]["_log"]]
        live_arena, live_ids = live["arena"], live["ids"]
        checks[f"arena_bytes_equal_{name}"] = bool(torch.equal(r.cache.arena, live_arena))
        # the rows of the committed tokens' KV (graph decode may have written a row past the last commit into
        # the live arena before the session was abandoned: not state the log holds)
        used = (r.n_tokens - 1) * r.cache.geometry.sections[0].row_bytes
        checks[f"arena_committed_rows_equal_{name}"] = bool(torch.equal(
            r.cache.arena.view(torch.uint8).flatten()[:used], live_arena.view(torch.uint8).flatten()[:used]))
        checks[f"ids_equal_{name}"] = r.ids == live_ids

    runs: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}

    def fresh_copy(name: str) -> Path:  # every recovery appends its first token's epoch: each gets the same log
        dst = d / "rep"
        shutil.rmtree(dst, ignore_errors=True)
        shutil.copytree(logs[RECOVERY_MODES[name]["_log"]]["log"], dst)
        (dst / "LOCK").unlink(missing_ok=True)
        return dst

    def mode_opts(name: str) -> dict[str, Any]:
        m = dict(RECOVERY_MODES[name])
        rec = dict(m["recovery"])
        if threads is not None and name != "baseline" and "threads" not in rec:
            rec["threads"] = threads
        m["recovery"] = rec
        return m

    # the process's first recovery pins its ring / image memory (cold): reported apart, not in the medians
    _warm_decode(model, device, max_len, lengths)
    cold = _recover_once(model, fresh_copy(modes[0]), backend, device, mode_opts(modes[0]), max_len)
    for _ in range(reps):
        for name in modes:
            rep_log = fresh_copy(name)
            _warm_decode(model, device, max_len, lengths)  # before the timer: the model is loaded and warm
            x = _recover_once(model, rep_log, backend, device, mode_opts(name), max_len)
            runs[name].append(x)
            print(f"rep {name}: " + " ".join(f"{k}={v:.2f}" for k, v in x.items() if isinstance(v, float)),
                  flush=True)  # what a run killed at its time limit still leaves
    if profile_dir is not None and "standby" in modes:  # one more, under cProfile (not in the medians)
        _warm_decode(model, device, max_len, lengths)
        _recover_once(model, fresh_copy("standby"), backend, device, mode_opts("standby"), max_len,
                      profile=profile_dir / "recovery_standby_profile.txt")
    for name in modes:  # untimed: the state checks, then the rest of the answer
        x = _recover_once(model, fresh_copy(name), backend, device, mode_opts(name), max_len,
                          check=lambda r, n=name: check(r, n))
        r = x["session"]
        out = r.resume()
        checks[f"tokens_equal_uninterrupted_{name}"] = out == want
        checks[f"resumed_in_graph_{name}"] = r._graph is not None and r._graph.stats.epochs > 0
        r.close()
    rows = []
    for name, timed in runs.items():
        row: dict[str, Any] = {
            "case": f"recover {n_prompt + n_new // 2}-token session (model loaded and warm)",
            "mode": name, "recovery_options": RECOVERY_MODES[name]["recovery"],
            "log_options": RECOVERY_MODES[name].get("log_options", {}),
            "write_log_options": RECOVERY_MODES[name].get("write_log_options", {}),
            "log_bytes": logs[RECOVERY_MODES[name]["_log"]]["log_bytes"],
            "log_segments": logs[RECOVERY_MODES[name]["_log"]]["segments"],
            "epochs_in_log": logs[RECOVERY_MODES[name]["_log"]]["epochs"], "reps": len(timed)}
        for key in ("total_ms", "recover_ms", "open_ms", "verify_ms", "check_ms", "construct_ms", "load_ms",
                    "recover_into_ms", "copy_ms", "restore_ms", "stream_ms", "stream_fill_wait_ms",
                    "stream_setup_ms", "stream_plan_ms", "other_ms", "first_token_ms", "decode_step_ms",
                    "checkpoint_ms", "standby_capture_ms", "standby_setup_ms"):
            vals = [x[key] for x in timed if x.get(key) is not None]
            row[key] = median(vals) if vals else None
        row["total_ms_p90"] = percentile([x["total_ms"] for x in timed], 90)
        row["total_plus_capture_ms"] = (row["total_ms"] + row["standby_capture_ms"]
                                        if row["standby_capture_ms"] is not None else row["total_ms"])
        row["verify_gb_s"] = row["log_bytes"] / 1e6 / max(1e-9, row["verify_ms"])
        row["stream_verified_bytes"] = timed[0].get("stream_verified_bytes")
        row["stream_bytes"] = timed[0].get("stream_bytes")
        row["first_token_graph"] = all(x["first_token_graph"] for x in timed)
        row["threads"] = timed[0]["threads"]
        row["reps_total_ms"] = [round(x["total_ms"], 2) for x in timed]
        if name == modes[0]:
            row["first_recovery_total_ms"] = cold["total_ms"]  # includes pinning the ring / image memory
        row["arena_bytes_equal"] = checks[f"arena_bytes_equal_{name}"]
        row["arena_committed_rows_equal"] = checks[f"arena_committed_rows_equal_{name}"]
        live_ids = logs[RECOVERY_MODES[name]["_log"]]["ids"]
        row["ids_equal"] = checks[f"ids_equal_{name}"] and all(x["ids"][:-1] == live_ids for x in timed)
        row["tokens_equal_uninterrupted"] = checks[f"tokens_equal_uninterrupted_{name}"]
        row["resumed_in_graph"] = checks[f"resumed_in_graph_{name}"]
        rows.append(row)
    shutil.rmtree(d, ignore_errors=True)
    return rows


# -------------------------------------------------------------------------------------------------- LoRA
LORA_MODES = ("none", "sync", "async")
ASYNC_MODES = ("async",)
# async modes that share one log, switched per mode (LogOptions fields, read at each append): none left (the
# placed-append variants they compared are gone; their result is in integrations/LLM.md)
MODE_OPTS: dict[str, dict[str, Any]] = {}
BACKPRESSURE_WAIT_S = 50e-6  # a checkpoint call that waited longer than this for the previous epoch "waited"


def lora_config(device: str, quick: bool) -> tuple[Any, int, str]:
    """Qwen2.5-0.5B dimensions; on a CPU with --quick, 2 layers and a 4k vocabulary (the code path, not speed)."""
    cfg = qwen25_05b()
    if quick and not device.startswith("cuda"):
        cfg.num_hidden_layers, cfg.vocab_size = 2, 4096
        return cfg, 64, "qwen2.5-0.5b dims, 2 layers, vocab 4096, seq 64 (CPU quick)"
    return cfg, 256, "qwen2.5-0.5b"


def bench_lora(log_root: Path, backend: str, device: str, quick: bool,
               modes: tuple[str, ...] = LORA_MODES) -> list[dict[str, Any]]:
    """Step time with no checkpoint, sync epochs and async epochs (three paths), interleaved rounds in one
    process.

    step delta = how long checkpointing holds the training step up: the checkpoint call's wall time on the
    training thread, and the difference of whole-step wall times (train_step including its checkpoint) against
    no checkpoint. Async epochs also report the commit latency (call -> epoch durable) and whether the
    backpressure (waiting for the previous epoch) ever held a step up."""
    import numpy as np
    from benchreport import percentile

    from concordia_ft.integrations.peft import LoraTrainer, synthetic_batch
    from concordia_ft.runtime import Runtime

    cfg, seq, what = lora_config(device, quick)
    base = build(cfg, device)
    d = Path(tempfile.mkdtemp(dir=log_root))
    t = LoraTrainer(base, d / "log", lr=1e-4, backend=backend, log_weights=True, async_checkpoint=False,
                    runtime_options=RT_OPTS)
    total_pages = sum(sp.n_pages for sp in t.runtime.table)
    # the CPU path: pinned host mirrors of the same dense state, CPU trackers, its own log (sync rounds only)
    mirrors = {n: torch.empty(b.shape, dtype=b.dtype, pin_memory=device.startswith("cuda"))
               for n, b in (("params", t.params_flat), ("adam", t.adam_flat))}
    rt_cpu = Runtime(str(d / "cpu-log"), fsync="never", backend=backend, **RT_OPTS)
    for n, m in mirrors.items():
        rt_cpu.register(f"lora.{n}", m, kind="dense")
    rounds, per_round = (1, 3) if quick else (LORA_ROUNDS, LORA_STEPS)
    wall: dict[str, list[float]] = {m: [] for m in modes}  # whole train_step, checkpoint call included
    compute: dict[str, list[float]] = {m: [] for m in modes}  # train_step before its checkpoint call
    call: dict[str, list[float]] = {m: [] for m in modes}  # the checkpoint call on the training thread
    amodes = [m for m in modes if m in ASYNC_MODES]
    handles: dict[str, list[Any]] = {m: [] for m in amodes}
    cpu_ms, pages, losses = [], [], []
    phases: dict[str, list[dict[str, float]]] = {m: [] for m in amodes}
    opts = t.runtime.log.options
    defaults = {k: getattr(opts, k) for o in MODE_OPTS.values() for k in o}
    gpu_detect, gpu_append, cpu_stage, cpu_append = [], [], [], []

    def batch(k: int) -> dict[str, torch.Tensor]:
        return synthetic_batch(k, vocab=cfg.vocab_size, batch=1, seq=seq, device=device)

    try:
        first_pages = t.train_step(batch(0)).pages  # the base epoch (weights immutable): sync, not timed
        for _ in range(rounds):
            for mode in modes:
                t.async_checkpoint = mode.startswith("async")
                for k, v in {**defaults, **MODE_OPTS.get(mode, {})}.items():
                    setattr(opts, k, v)
                t.train_step(batch(t.step), checkpoint=mode != "none")  # warm-up of this mode, not timed
                for _ in range(per_round):  # back to back, as a training loop runs (no device sync between)
                    s0 = time.perf_counter()
                    res = t.train_step(batch(t.step), checkpoint=mode != "none")
                    s1 = time.perf_counter()
                    wall[mode].append(s1 - s0)
                    compute[mode].append(res.step_s)
                    call[mode].append(res.checkpoint_s)
                    losses.append(res.loss)
                    if mode.startswith("async"):
                        handles[mode].append(t.runtime.in_flight)
                        # the previous async epoch has finished (this step's checkpoint waited for it): its
                        # placed append's phases (a mapped DRAM log), when it took that path
                        ph = getattr(t.runtime.log, "last_placed_phases", {})
                        if ph and len(handles[mode]) > 1:
                            phases[mode].append(dict(ph))
                    if mode != "sync":
                        continue
                    pages.append(res.pages)
                    gst = t.runtime.last_stats
                    gpu_detect.append(1e3 * gst.detect_seconds)
                    gpu_append.append(1e3 * gst.append_seconds)
                    sync(device)
                    c0 = time.perf_counter()
                    mirrors["params"].copy_(t.params_flat, non_blocking=True)
                    mirrors["adam"].copy_(t.adam_flat, non_blocking=True)
                    sync(device)
                    c_staged = time.perf_counter()
                    rt_cpu.checkpoint(meta={"step": t.step})
                    cpu_ms.append(1e3 * (time.perf_counter() - c0))
                    cst = rt_cpu.last_stats
                    cpu_stage.append(1e3 * (c_staged - c0 + cst.detect_seconds))
                    cpu_append.append(1e3 * cst.append_seconds)
                t.wait()  # the last async epoch commits before the next mode's steps are timed
                if mode.startswith("async") and t.runtime.log.last_placed_phases:
                    phases[mode].append(dict(t.runtime.log.last_placed_phases))  # the mode's last epoch
        stats = {m: [h.stats for h in handles[m]] for m in amodes}
        call_only = [h.call_seconds for h in handles.get("async", [])]
        snapshot_bytes = t.runtime.snapshot_device_bytes
        plan = getattr(t.runtime, "_plan", None)  # how the async epochs staged the dense regions (None before)
        batches = "; ".join(f"{type(b).__name__} {','.join(names)}"
                            + (f": {len(b.copies)} D2D copies" if hasattr(b, "copies") else "")
                            for _, names, b in (plan.batches if plan is not None else []))
        lora_regions = ",".join(sorted(sp.name for sp in t.runtime.table if sp.kind.value != "immutable"))
        spare = getattr(t.runtime.log, "_spare", None)
        worker = dict(spare.stats) if spare is not None else {}
    finally:
        t.close()
        rt_cpu.close()
        shutil.rmtree(d, ignore_errors=True)
    assert np.isfinite(losses).all() and all(st is not None for m in amodes for st in stats[m]), \
        "an async epoch failed"
    ms = {m: 1e3 * median(wall[m]) for m in modes}
    per_s = {m: len(wall[m]) / sum(wall[m]) for m in modes}
    latency = {m: [1e3 * st.commit_latency_seconds for st in stats[m]] for m in amodes}

    def phase_medians(rows: list[dict[str, float]]) -> dict[str, float]:
        return {k: (1e3 if k not in ("rolled", "registered", "gated") else 1.0) * median([p[k] for p in rows])
                for k in rows[0]} if rows else {}

    def rolled(m: str) -> float:
        return sum(p.get("rolled", 0) for p in phases[m]) / max(1, len(phases[m]))

    row: dict[str, Any] = {
        "case": f"LoRA SFT {what} r=8 all proj, AdamW", "adapter_params": t.n_adapter_params,
        "adapter_pages": -(-t.n_adapter_params * 4 // 4096), "modes": list(modes),
        "total_pages": total_pages, "first_epoch_pages": first_pages,
        "step_ms": 1e3 * median([x for m in modes for x in compute[m]]),  # before the checkpoint
        "lora_regions": lora_regions, "async_dense_batches": batches,
        "step_wall_ms_none": ms.get("none"), "steps_per_mode": per_round * rounds,
        "losses_first_last": [losses[0], losses[-1]],
        "segment_worker": worker,
    }
    for m in amodes:
        lat, waits = latency[m], [st.backpressure_seconds for st in stats[m]]
        row.update({
            # the commit latency: the checkpoint_async call -> the epoch committed (the crash loss window)
            f"commit_latency_ms_{m}": median(lat), f"commit_latency_ms_{m}_p90": percentile(lat, 90),
            f"commit_latency_ms_{m}_max": max(lat),
            # the training thread: the checkpoint call, and whole steps against no checkpoint
            f"delta_ms_{m}": 1e3 * median(call[m]), f"delta_ms_{m}_p90": 1e3 * percentile(call[m], 90),
            f"step_wall_ms_{m}": ms[m], f"steps_per_s_{m}": per_s[m],
            f"find_stage_ms_{m}_background": median([1e3 * st.detect_seconds for st in stats[m]]),
            f"log_append_ms_{m}_background": median([1e3 * st.append_seconds for st in stats[m]]),
            f"backpressure_waits_{m}": sum(w > BACKPRESSURE_WAIT_S for w in waits),
            f"backpressure_max_ms_{m}": 1e3 * max(waits),
            # the log append into a mapped DRAM log, by phase (medians, ms): roll = lay out (+ roll to the next
            # segment), place = DMA issued, wait = DMA waited for (with the CRC of the chunks as they land; it
            # includes the GPU finishing the step and its snapshot), dma = the copies on the GPU (events),
            # crc = what is left of the CRC + the head, write = header + commit marker
            f"{m}_append_phases_ms": phase_medians(phases[m]), f"{m}_rolled_fraction": rolled(m),
        })
        if "none" in modes:
            row[f"step_delta_ms_{m}"] = ms[m] - ms["none"]
    if "async" in amodes:
        lat = latency["async"]
        row.update({"async_checkpoint_async_call_ms": 1e3 * median(call_only),
                    "async_epochs": len(lat), "snapshot_device_mib": snapshot_bytes / 2**20,
                    "async_dirty_pages_per_step": median([st.pages for st in stats["async"]]),
                    "target_0.5ms_met_async_call": 1e3 * median(call["async"]) <= 0.5,
                    "target_3ms_met_commit_latency": median(lat) <= 3.0,
                    "target_3ms_met_commit_latency_p90": percentile(lat, 90) <= 3.0})
        for base in ("async_prev", "async_old"):
            if base in amodes:
                row[f"commit_latency_{base}_over_new_x"] = median(latency[base]) / max(1e-9, median(lat))
    if "sync" in modes:
        row.update({
            "dirty_pages_per_step": median(pages), "delta_ms_gpu_handlers": 1e3 * median(call["sync"]),
            "delta_ms_cpu_path": median(cpu_ms), "speedup_x": median(cpu_ms) / max(1e-9, 1e3 * median(call["sync"])),
            "step_wall_ms_sync": ms["sync"], "steps_per_s_sync": per_s["sync"],
            "find_stage_ms_gpu": median(gpu_detect), "find_stage_ms_cpu_path": median(cpu_stage),
            "log_append_ms_gpu": median(gpu_append), "log_append_ms_cpu_path": median(cpu_append)})
        if "none" in modes:
            row["step_delta_ms_sync"] = ms["sync"] - ms["none"]
        if "async" in amodes:
            row["async_vs_sync_x"] = median(call["sync"]) / max(1e-12, median(call["async"]))
    if "none" in modes:
        row["steps_per_s_none"] = per_s["none"]
    row["commit_latency_ms_lists"] = latency
    # each epoch's append phases (ms; rolled/gated/registered as 0/1), for the tail
    row["append_phases_ms_lists"] = {m: [{k: round(v * (1 if k in ("rolled", "registered", "gated") else 1e3), 3)
                                          for k, v in p.items()} for p in phases[m]] for m in amodes}
    row["step_wall_ms_lists"] = {m: [1e3 * x for x in wall[m]] for m in modes}
    row["checkpoint_call_ms_lists"] = {m: [1e3 * x for x in call[m]] for m in modes if m != "none"}
    return [row]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--only", default="decode,base,recovery,lora")
    ap.add_argument("--lora-rounds", type=int, default=3, help="interleaved rounds of the LoRA modes (8 steps each)")
    ap.add_argument("--name", default="llm", help="results file name: <out>/<name>-<device>.json")
    ap.add_argument("--lora-steps", type=int, default=8, help="timed steps per mode and round")
    ap.add_argument("--lora-modes", default=",".join(LORA_MODES),
                    help=f"LoRA modes, interleaved in this order (of {','.join(LORA_MODES)})")
    ap.add_argument("--recovery-reps", type=int, default=None, help="timed recoveries per path (default 6)")
    ap.add_argument("--recovery-threads", type=int, default=None,
                    help="replay threads of the new recovery path (default: min(8, CPUs))")
    ap.add_argument("--recovery-modes", default="today,standby,standby_verify_at_open,standby_64mib_log",
                    help=f"recovery modes, interleaved (of {', '.join(RECOVERY_MODES)}); the first is the baseline")
    ap.add_argument("--profile-dir", default=None, help="write a cProfile of one standby recovery here")
    a = ap.parse_args()
    global LORA_ROUNDS, LORA_STEPS
    LORA_ROUNDS, LORA_STEPS = a.lora_rounds, a.lora_steps
    work = Path(tempfile.mkdtemp(prefix="cft-llm-"))
    log_root, backend = log_place(work, 3 << 30)
    print(f"device {a.device}, log backend {backend} in {log_root}", flush=True)
    rows: list[dict[str, Any]] = []
    errors: list[str] = []
    parts = a.only.split(",")
    model = build(qwen3_06b(), a.device) if set(parts) & {"decode", "base", "recovery"} else None
    for part in parts:
        t0 = time.time()
        try:
            if part == "decode":
                rows += bench_decode(model, log_root, backend, a.device, a.quick)
            elif part == "base":
                rows += bench_base(model, log_root, backend, a.device)
            elif part == "recovery":
                rows += bench_recovery(model, log_root, backend, a.device, a.quick, a.recovery_threads,
                                       a.recovery_reps, tuple(a.recovery_modes.split(",")),
                                       Path(a.profile_dir) if a.profile_dir else None)
            elif part == "lora":
                del model
                model = None
                torch.cuda.empty_cache() if a.device.startswith("cuda") else None
                lora_modes = tuple(m for m in a.lora_modes.split(",") if m)
                bad = [m for m in lora_modes if m not in LORA_MODES]
                if bad:
                    raise SystemExit(f"unknown LoRA modes {bad}; use some of {','.join(LORA_MODES)}")
                rows += bench_lora(log_root, backend, a.device, a.quick, lora_modes)
        except Exception as e:  # noqa: BLE001 - record and go on: one broken part must not hide the others
            errors.append(f"{part}: {type(e).__name__}: {e}")
            traceback.print_exc()
        print(f"[{part}] {time.time() - t0:.1f} s", flush=True)
    shutil.rmtree(log_root, ignore_errors=True)
    shutil.rmtree(work, ignore_errors=True)
    notes = ("random weights, bf16; decode = Session's own loop (eager), overhead from 5 interleaved rounds (none, every token sync, every token async) in one "
             f"process; log backend {backend}, fsync never. Recovery: before each timed recovery the model runs "
             "one decode step on a throwaway cache of the same shape (a serving process that has loaded and "
             "warmed its model); everything that depends on the log (open, verify, copy, restore, the first "
             "token and its epoch) is inside the timer; a Standby (arena + decode graph captured) is made "
             "before the timer (standby_capture_ms / standby_setup_ms report it; total_plus_capture_ms adds "
             "the capture); the process's first recovery also pins its ring / image memory and is reported "
             "apart (first_recovery_total_ms). After the timed reps one untimed recovery per mode checks the "
             "arena and ids byte for byte and resumes to the end (tokens_equal_uninterrupted). "
             f"errors: {errors or 'none'}")
    path = write_results(a.name, rows, baseline=[{"case": "checkpoint none / CPU path: columns *_no_ckpt and "
                                                 "delta_ms_cpu_path of the rows"}], notes=notes, out_dir=a.out)
    print(f"wrote {path}")
    for r in rows:
        scalars = {k: v for k, v in r.items() if not isinstance(v, list | dict)}
        if len(scalars) > 14:  # a wide row (LoRA) reads better as metric | value
            print_table(r["case"], [{"metric": k, "value": v} for k, v in scalars.items() if k != "case"])
        else:
            print_table(r["case"], [scalars])
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
