"""A real writer (or compactor) process for the SIGKILL tests; also the model the parent checks against.

    python tests/crash_writer.py write LOG_DIR SEED [--epochs N] [--compact-after BYTES] [--fsync always]
    python tests/crash_writer.py compact LOG_DIR [--kill-at POINT]

`write` opens the log (continuing after its last committed epoch: a reopened log cuts a torn tail), restores
the regions, then forever (or N times): mutates the regions deterministically for epoch e, checkpoints, and
prints "E <e>" only after checkpoint() returned. The state after epoch e depends only on (seed, e), so the
parent rebuilds it with ``model_states`` whichever process wrote which epoch.
`compact` runs compact_offline, SIGKILLing itself at the named point (base-writing, base-written,
before-manifest, after-manifest) when asked.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from collections.abc import Iterator

import numpy as np

PAGE = 4096
SIZES = {"opq": (1 << 20) + 123, "hsh": 256 << 10, "kv": 2 << 20, "dense": (64 << 10) + 5}
KV_BLOCK = 16 << 10


def initial_state(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng([seed, 0])
    return {n: rng.integers(0, 256, size, dtype=np.uint8) for n, size in SIZES.items()}


def mutate(state: dict[str, np.ndarray], bitmap: np.ndarray | None, seed: int, epoch: int) -> None:
    """Apply epoch ``epoch``'s writes in place (and mark the KV blocks it wrote)."""
    rng = np.random.default_rng([seed, epoch])
    opq = state["opq"]
    for p in rng.choice(opq.size // PAGE + 1, size=int(rng.integers(1, 40)), replace=False):
        lo = int(p) * PAGE
        idx = rng.integers(lo, min(lo + PAGE, opq.size), 4)
        opq[idx] = rng.integers(0, 256, 4, dtype=np.uint8)
    hsh = state["hsh"]
    start = int(rng.integers(0, hsh.size - 3 * PAGE))
    hsh[start : start + int(rng.integers(1, 3 * PAGE))] ^= np.uint8(int(rng.integers(1, 256)))
    kv = state["kv"]
    n_blocks = kv.size // KV_BLOCK
    for b in rng.choice(n_blocks, size=int(rng.integers(1, 12)), replace=False):
        kv[b * KV_BLOCK : (b + 1) * KV_BLOCK] = rng.integers(0, 256, KV_BLOCK, dtype=np.uint8)
        if bitmap is not None:
            bitmap[b] = 1
    state["dense"][:] = rng.integers(0, 256, state["dense"].size, dtype=np.uint8)


def model_states(seed: int) -> Iterator[tuple[int, dict[str, np.ndarray]]]:
    """(epoch, state after it) for epoch 1, 2, ...: the same arrays, mutated in place (copy what you keep)."""
    state = initial_state(seed)
    e = 0
    while True:
        e += 1
        mutate(state, None, seed, e)
        yield e, state


def write(log_dir: str, seed: int, epochs: int | None, compact_after: int | None, fsync: str,
          backend: str = "file") -> None:
    import concordia_ft as cft

    state = initial_state(seed)
    bitmap = np.zeros(SIZES["kv"] // KV_BLOCK, dtype=np.uint8)
    # dram: mapped segments (stores into a preallocated MAP_SHARED file), small so that they roll often
    rt = cft.Runtime(log_dir, fsync=fsync, compact_after_bytes=compact_after, background_compaction=True,
                     backend=backend, log_options={"mapped_segment_bytes": 4 << 20} if backend == "dram" else None)
    rt.register("opq", state["opq"], "opaque")
    rt.register("hsh", state["hsh"], "opaque", diff="hash")
    rt.register("kv", state["kv"], "paged", block_bytes=KV_BLOCK, dirty_blocks=bitmap)
    rt.register("dense", state["dense"], "dense")
    if rt.epoch is not None:
        rec = rt.recover_into()
        assert rec.meta == {"epoch": rec.epoch}, rec.meta
    done = rt.epoch or 0
    print(f"OPEN {done} cut={rt.open_report.cut_bytes}", flush=True)
    n = 0
    while epochs is None or n < epochs:
        e = done + 1
        mutate(state, bitmap, seed, e)
        got = rt.checkpoint({"epoch": e})
        assert got == e, (got, e)
        print(f"E {e}", flush=True)
        done = e
        n += 1
    rt.close()


def compact(log_dir: str, kill_at: str | None) -> None:
    from concordia_ft.core.compaction import compact_offline

    def hook(point: str) -> None:
        if point == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)

    r = compact_offline(log_dir, kill_hook=hook)
    print(f"COMPACTED {r.compacted} {r.epoch}", flush=True)


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("write")
    w.add_argument("log_dir")
    w.add_argument("seed", type=int)
    w.add_argument("--epochs", type=int, default=None)
    w.add_argument("--compact-after", type=int, default=None)
    w.add_argument("--fsync", default="always")
    w.add_argument("--backend", default="file")
    c = sub.add_parser("compact")
    c.add_argument("log_dir")
    c.add_argument("--kill-at", default=None)
    a = p.parse_args(argv)
    if a.cmd == "write":
        write(a.log_dir, a.seed, a.epochs, a.compact_after, a.fsync, a.backend)
    else:
        compact(a.log_dir, a.kill_at)


if __name__ == "__main__":
    main(sys.argv[1:])
