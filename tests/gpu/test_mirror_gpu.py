"""The pinned log mirror (cuda/mirror.py) on a GPU: a server SIGKILLed with its mirror caught up is restored from
that mirror by a new process (chunks DMA'd from memory the keeper held, no ring fill), byte for byte and
token for token against the log alone; a mirror whose bytes disagree with the log is never served (the device
checksum catches it and the restore runs again from the log); no keeper, no mirror: the plain restore."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from concordia_ft.core.keeper import KeeperClient, stop_keeper
from concordia_ft.serve import Engine, SamplingParams
from support import REPO

MODEL = textwrap.dedent("""
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config
    def bf16_model():
        torch.manual_seed(0)
        cfg = Qwen3Config(vocab_size=8192, hidden_size=1024, intermediate_size=3072, num_hidden_layers=4,
                          num_attention_heads=16, num_key_value_heads=8, head_dim=128)
        with torch.device("cuda"):
            return AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
    def prompts():
        g = torch.Generator().manual_seed(2)
        return [torch.randint(0, 8192, (int(n),), generator=g).tolist() for n in (70, 33, 120, 64, 90, 17)]
    OPTS = {"num_blocks": 48, "block_size": 16, "max_running": 8, "max_model_len": 256, "max_batch_tokens": 320,
            "backend": "dram"}
""")

SERVER = MODEL + textwrap.dedent("""
    import sys
    from concordia_ft.serve import Engine, SamplingParams
    log, pool_out = sys.argv[1], sys.argv[2]
    eng = Engine(bf16_model(), log, {**OPTS, "mirror": True})
    for i, p in enumerate(prompts()):
        eng.submit(p, SamplingParams(max_new_tokens=40, temperature=0.0, ignore_eos=True), request_id=f"r{i}")
    for _ in range(10):
        eng.step()
    torch.cuda.synchronize()
    assert eng.mirror.wait_caught_up(60.0)
    torch.save(eng.pool.arena.cpu(), pool_out)
    print("READY", eng.mirror.mirrored_bytes, flush=True)
    import time
    time.sleep(600)  # SIGKILLed here, mid-service, its log and its mirror as they are
""")


@pytest.fixture()
def shm() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(dir="/dev/shm", prefix="cft-mirror-gpu-"))
    yield d
    stop_keeper(d / "log")
    shutil.rmtree(d, ignore_errors=True)


def _model_ns() -> dict:  # type: ignore[type-arg]
    ns: dict = {}  # type: ignore[type-arg]
    exec(MODEL, ns)  # noqa: S102 - the same model the server process builds
    return ns


def _serve_steps(model: torch.nn.Module, log: Path, steps: int, *, mirror: bool) -> tuple[Engine, torch.Tensor]:
    """An engine on ``log`` that ran ``steps`` steps of the server's workload in this process, and its pool."""
    ns = _model_ns()
    eng = Engine(model, log, {**ns["OPTS"], "mirror": mirror})
    for i, p in enumerate(ns["prompts"]()):
        eng.submit(p, SamplingParams(max_new_tokens=40, temperature=0.0, ignore_eos=True), request_id=f"r{i}")
    for _ in range(steps):
        eng.step()
    torch.cuda.synchronize()
    return eng, eng.pool.arena.clone()


def _copy(log: Path, dst: Path) -> Path:
    shutil.copytree(log, dst)
    (dst / "LOCK").unlink(missing_ok=True)
    return dst


def test_a_sigkilled_server_is_restored_from_its_pinned_mirror_byte_for_byte(shm: Path) -> None:
    log, pool_file = shm / "log", shm / "pool.pt"
    env = {**os.environ, "PYTHONPATH": str(REPO / "src") + os.pathsep + os.environ.get("PYTHONPATH", "")}
    srv = subprocess.Popen([sys.executable, "-c", SERVER, str(log), str(pool_file)], stdout=subprocess.PIPE,
                           text=True, env=env)
    assert srv.stdout is not None
    line = srv.stdout.readline().split()
    assert line and line[0] == "READY", line
    assert int(line[1]) > 1 << 20
    os.kill(srv.pid, signal.SIGKILL)
    assert srv.wait() == -signal.SIGKILL
    assert KeeperClient(log).ping() is not None  # the keeper outlived the server
    pool = torch.load(pool_file).cuda()
    plain = _copy(log, shm / "plain")  # the log alone, before the mirrored recovery appends to it
    ns = _model_ns()
    model = ns["bf16_model"]()
    # a tiny ring so that plenty of chunks exist; the one-run ones come from the mirror
    rec = Engine.recover(log, model, {"mirror": True, "backend": "dram"}, recovery={"ring_slots": 3, "slot_bytes": 64 << 10})
    st = rec.recovered.streamed["kv"]
    assert st.extra["mirror_chunks"] > 0 and st.extra["mirror_bytes"] > 0, st.extra
    assert st.extra.get("mirror_fallback", 0.0) == 0.0
    assert st.extra["verify_on_device"] == 1.0 and st.extra["device_verified_pieces"] > 0
    assert torch.equal(rec.pool.arena, pool)
    old = Engine.recover(plain, model, {"backend": "dram"}, recovery={"streamed": False})
    assert torch.equal(old.pool.arena, pool)
    for _ in range(3):
        a, b = rec.step(), old.step()
        assert a.new_tokens == b.new_tokens and a.new_tokens
    # the recovered engine mirrors its own log from here on (EngineOptions.mirror)
    assert rec.mirror is not None and rec.mirror.wait_caught_up(60.0)
    rec.close()
    old.close()


def test_a_mirror_that_disagrees_with_the_log_is_never_served(shm: Path) -> None:
    model = _model_ns()["bf16_model"]()
    log = shm / "log"
    eng, pool = _serve_steps(model, log, 10, mirror=True)
    mirror, eng.mirror = eng.mirror, None
    eng.close()
    assert mirror.wait_caught_up(60.0)
    # flip bytes all through the mirror's copy of the first incremental segment (KV rows among them)
    seg = min(n for n in mirror._segs if n.startswith("incr."))
    view = mirror._segs[seg].mem.host_view()
    mark = mirror._segs[seg].mark
    view[4096:mark:4096] ^= 0x5A
    mirror.close()
    rec = Engine.recover(log, model, {"backend": "dram"}, recovery={"mirror": True, "ring_slots": 3, "slot_bytes": 64 << 10})
    st = rec.recovered.streamed["kv"]
    assert st.extra["mirror_fallback"] == 1.0, st.extra
    assert torch.equal(rec.pool.arena, pool)
    rec.close()


def test_no_keeper_means_the_plain_restore(shm: Path) -> None:
    model = _model_ns()["bf16_model"]()
    log = shm / "log"
    eng, pool = _serve_steps(model, log, 6, mirror=False)
    eng.close()
    rec = Engine.recover(log, model, {"backend": "dram"}, recovery={"mirror": True})
    st = rec.recovered.streamed["kv"]
    assert "no mirror keeper" in str(st.extra.get("mirror_unused")), st.extra
    assert "mirror_chunks" not in st.extra
    assert torch.equal(rec.pool.arena, pool)
    rec.close()
