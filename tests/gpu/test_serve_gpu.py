"""The serving engine on a GPU: the attention runs no cuDNN kernel and a step is bitwise reproducible; decode
steps replayed from CUDA graphs equal the same static steps run eagerly, bit for bit (tokens and the KV pool),
and the variable-shape eager engine token for token; a log written with graphs on recovers token-exact."""

from __future__ import annotations

import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from concordia_ft.serve import Engine, SamplingParams
from support import REPO

sys.path.insert(0, str(REPO / "tests"))
from llm_helpers import tiny_model  # noqa: E402
from serve_workload import OPTIONS, drive, workload  # noqa: E402


@pytest.fixture()
def shm() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(dir="/dev/shm", prefix="cft-serve-gpu-"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _bf16_model() -> torch.nn.Module:
    """Qwen3-0.6B's layer dims (bf16, default random init), 4 layers and a small vocabulary: the kernels the
    0.6B benchmark runs, in a fraction of the time."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=8192, hidden_size=1024, intermediate_size=3072, num_hidden_layers=4,
                      num_attention_heads=16, num_key_value_heads=8, head_dim=128)
    with torch.device("cuda"):
        return AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()


def _run(model: torch.nn.Module, graphs: str, prompts: list[list[int]], new: int = 24) -> tuple[list, Engine]:
    eng = Engine(model, None, {"num_blocks": 64, "block_size": 16, "max_running": 16, "max_model_len": 256,
                               "max_batch_tokens": 512, "checkpoint": False, "graphs": graphs})
    # fixed ids: the batch order and the blocks each request gets are a function of them
    reqs = [eng.submit(p, SamplingParams(max_new_tokens=new, temperature=0.0, ignore_eos=True), request_id=f"r{i}")
            for i, p in enumerate(prompts[:5])]
    eng.step()
    reqs += [eng.submit(p, SamplingParams(max_new_tokens=new - 4, temperature=0.0, ignore_eos=True),
                        request_id=f"r{i + 5}")
             for i, p in enumerate(prompts[5:])]  # late joiners: batch sizes change, several buckets
    while eng.has_work:
        eng.step()
    torch.cuda.synchronize()
    return [r.generated for r in reqs], eng


def _prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(2)
    return [torch.randint(3, vocab, (int(n),), generator=g).tolist() for n in (40, 7, 100, 3, 64, 17, 90, 33, 5)]


def test_attention_uses_no_cudnn_and_steps_are_bitwise_reproducible() -> None:
    model = _bf16_model()
    ps = _prompts(8192)
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA], acc_events=True) as prof:
        toks_a, a = _run(model, "off", ps)
    names = {e.name for e in prof.events() if e.device_type.name == "CUDA"}
    attn = sorted(n for n in names if "fmha" in n.lower() or "attention" in n.lower() or "cudnn" in n.lower())
    print("attention kernels:", attn[:6])
    assert not any("cudnn" in n.lower() for n in names), attn
    toks_b, b = _run(model, "off", ps)
    assert toks_a == toks_b
    assert torch.equal(a.pool.arena, b.pool.arena)  # every K/V byte the two runs wrote
    toks_c, c = _run(model, "on", ps)
    toks_d, d = _run(model, "on", ps)
    assert c.graphs is not None and c.graphs.replays > 20 and len(c.graphs.statics) >= 2
    assert toks_c == toks_d and torch.equal(c.pool.arena, d.pool.arena)


def test_graph_replay_equals_the_same_static_step_eager_bit_for_bit() -> None:
    model = _bf16_model()
    ps = _prompts(8192)
    toks_g, g = _run(model, "on", ps)
    toks_p, p = _run(model, "padded", ps)
    assert g.graphs is not None and all(st.graph is not None for st in g.graphs.statics.values())
    assert g.graphs.replays == p.graphs.replays > 20
    assert toks_g == toks_p
    assert torch.equal(g.pool.arena, p.pool.arena)


def test_graphs_equal_the_eager_engine_and_recover_token_exact(shm: Path) -> None:
    model = tiny_model("llama").cuda()
    ref_off = drive(Engine(model, None, {**OPTIONS, "checkpoint": False, "graphs": "off"}), workload())
    ref_on = drive(Engine(model, None, {**OPTIONS, "checkpoint": False}), workload())
    assert ref_on == ref_off  # fp32, weights far from ties: the padded shapes change no token
    eng = Engine(model, shm / "log", OPTIONS)
    assert eng.graphs is not None and eng.graphs.mode == "on"
    drive(eng, workload(), max_steps=12)
    assert eng.graphs.replays > 0
    eng.close()
    rec = Engine.recover(shm / "log", model)
    assert rec.graphs is not None and rec.graphs.mode == "on"
    assert drive(rec, workload()) == ref_on  # greedy and seeded requests, continued where the log left them
    assert rec.graphs.replays > 0
    rec.close()


def test_async_epochs_with_graphs_recover_token_exact(shm: Path) -> None:
    model = tiny_model("qwen3").cuda()
    ref = drive(Engine(model, None, {**OPTIONS, "checkpoint": False}), workload())
    eng = Engine(model, shm / "log", {**OPTIONS, "async_epochs": True})
    drive(eng, workload(), max_steps=12)
    assert eng.graphs is not None and eng.graphs.replays > 0
    eng.close()
    rec = Engine.recover(shm / "log", model)
    assert drive(rec, workload()) == ref
    rec.close()


@pytest.mark.parametrize(("pipelined", "depth", "cap", "bulk"), [
    (False, 1, 0, "auto"), (True, 1, 0, "auto"), (True, 8, 0, "auto"), (False, 1, 8, "auto"), (True, 8, 8, "auto"),
    (False, 1, 8, "c"), (True, 8, 8, "c")])
def test_step_epochs_with_graphs_log_the_generic_state_and_recover_token_exact(
        shm: Path, pipelined: bool, depth: int, cap: int, bulk: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Step epochs on the GPU (rows gathered on the device into the pinned ring, inside the graph steps' stream
    order; the previous step's epoch handed to the writer after the next forward's launch when pipelined; with
    ``cap`` the prefill chunks are more rows than a ring slot: DMA'd into the log's mapped segment by the placed
    path (``bulk`` "auto"), or gathered into the bulk buffer in pieces ("c")): the same tokens as no log, the log
    replays to the same KV / tokens / rng bytes and metadata as the generic path's, every flag the step path
    logged is clear, and a recovered engine continues token-exact."""
    monkeypatch.setenv("CONCORDIA_STEP_EPOCH_BULK", bulk)
    from concordia_ft.core.replay import replay
    from concordia_ft.serve.stepepochs import StepEpochs

    model = tiny_model("qwen3").cuda()
    ref = drive(Engine(model, None, {**OPTIONS, "checkpoint": False}), workload())
    opts = {**OPTIONS, "backend": "dram", "async_epochs": pipelined, "async_depth": depth}
    g = Engine(model, shm / "generic", {**opts, "step_epochs": "runtime"})
    c = Engine(model, shm / "c", opts)  # step_epochs="auto": the C path on a CUDA model
    assert g.fast is None and c.fast is not None
    if cap:
        c.fast = StepEpochs(c, cap_rows=cap, slots=c.fast.n_slots)
    assert drive(g, workload(), max_steps=14) == drive(c, workload(), max_steps=14)
    assert c.graphs is not None and c.graphs.replays > 0 and c.fast.steps >= 8
    assert (c.fast.bulk_steps > 0) == (bool(cap) and bulk == "c") and c.fast.fallbacks == 0
    assert (c.fast.placed_steps > 0) == (bool(cap) and bulk == "auto")
    c.fast.suspend()  # (pipelined: the last step's epoch is deferred until then; it takes its flags)
    torch.cuda.synchronize()
    assert not c.pool.dirty.any().item() and not c.tokens_dirty.any() and not c.rng.dirty.any()
    g.close()
    c.close()
    rg, rc = replay(shm / "generic"), replay(shm / "c")
    assert rg.epoch == rc.epoch
    mg, mc = rg.meta["concordia.serve"], rc.meta["concordia.serve"]
    mg.pop("time")
    mc.pop("time")
    assert mg == mc
    for k in ("kv", "tokens", "rng"):
        assert bytes(rg.regions[k].data) == bytes(rc.regions[k].data), k
    rec = Engine.recover(shm / "c", model, {"step_epochs": "c", "async_epochs": pipelined})
    assert drive(rec, workload()) == ref
    assert rec.fast.steps > 0
    rec.close()


def _pool_log(shm: Path, model: torch.nn.Module, *, slots_reused: bool) -> tuple[Path, torch.Tensor, Engine]:
    """A bf16 engine's log: prompts prefilled in chunks, decodes, requests that finish (their blocks reused by
    later ones when ``slots_reused``); returns the log, a copy of the pool as it was at the last epoch and the
    closed engine."""
    eng = Engine(model, shm / "log", {"num_blocks": 48, "block_size": 16, "max_running": 8, "max_model_len": 256,
                                      "max_batch_tokens": 320})
    for i, p in enumerate(_prompts(8192)[:6]):
        eng.submit(p, SamplingParams(max_new_tokens=12 + 6 * (i % 3), temperature=0.0, ignore_eos=True))
    for _ in range(24 if slots_reused else 10):
        if eng.has_work:
            eng.step()
        if slots_reused and len(eng.finished) >= 2 and not eng.waiting:
            eng.submit(_prompts(8192)[0][:40], SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True))
    torch.cuda.synchronize()
    assert eng.running
    pool = eng.pool.arena.clone()
    eng.close()
    return shm / "log", pool, eng


@pytest.mark.parametrize("slots_reused", [False, True])
@pytest.mark.parametrize("loop", ["python", "python_nt"])
def test_streamed_restore_gives_the_pool_byte_for_byte_and_the_image_path_agrees(shm: Path, slots_reused: bool,
                                                                                   loop: str) -> None:
    model = _bf16_model()
    log, pool, _ = _pool_log(shm, model, slots_reused=slots_reused)
    copy = shm / "copy"
    shutil.copytree(log, copy)
    (copy / "LOCK").unlink(missing_ok=True)
    # a tiny ring (3 slots of 64 KiB) so that chunks wrap it many times, some straight into place, some scattered;
    # "python_nt": the fills write the ring with streaming stores (RecoveryOptions.nontemporal)
    rec = Engine.recover(log, model, recovery={"ring_slots": 3, "slot_bytes": 64 << 10,
                                               "nontemporal": loop.endswith("_nt")})
    st = rec.recovered.streamed["kv"]
    assert st.extra["nontemporal"] == float(loop.endswith("_nt"))
    assert st.chunks > 6 and 0 < st.direct_chunks < st.chunks
    assert torch.equal(rec.pool.arena, pool)
    old = Engine.recover(copy, model, recovery={"streamed": False})
    assert old.recovered.streamed == {}
    assert torch.equal(old.pool.arena, pool)
    a, b = rec.step(), old.step()
    assert a.new_tokens == b.new_tokens and len(a.new_tokens) == len(rec.running) + len(a.finished)
    rec.close()
    old.close()


@pytest.mark.parametrize("verify", ["device", "host"])
def test_streamed_restore_refuses_a_damaged_kv_payload_before_anything_is_restored(shm: Path, verify: str) -> None:
    from concordia_ft.errors import LogCorruptError

    model = _bf16_model()
    log, _, _ = _pool_log(shm, model, slots_reused=False)
    seg = sorted(log.glob("incr.*.cft"))[0]
    data = bytearray(seg.read_bytes())
    data[len(data) // 3] ^= 0x10  # inside a prefill epoch's KV rows
    seg.write_bytes(bytes(data))
    copy = shm / "copy"
    shutil.copytree(log, copy)
    (copy / "LOCK").unlink(missing_ok=True)
    # the default: the pool's checksums run by the streamed restore, on the bytes it copies; Engine.recover
    # raises, so no engine exists to serve a restored block
    with pytest.raises(LogCorruptError, match="'kv'.*checksum mismatch \\(found by the restore"):
        Engine.recover(log, model, recovery={"stream_verify": verify})
    # every checksum at the open: refused before the pool even exists
    with pytest.raises(LogCorruptError, match="'kv'.*checksum mismatch") as e:
        Engine.recover(copy, model, recovery={"defer_verify": ()})
    assert "found by the restore" not in str(e.value)


def test_the_first_step_after_recovery_replays_a_graph_captured_beside_the_restore(shm: Path) -> None:
    model = _bf16_model()
    eng = Engine(model, shm / "log", {"num_blocks": 48, "block_size": 16, "max_running": 8, "max_model_len": 256,
                                      "max_batch_tokens": 512})
    for p in _prompts(8192)[:5]:
        eng.submit(p[:40], SamplingParams(max_new_tokens=40, temperature=0.0, ignore_eos=True))
    for _ in range(4):  # the prefill, then decodes: the log ends in a decode-only state
        eng.step()
    eng.close()
    copy = shm / "copy"
    shutil.copytree(shm / "log", copy)
    (copy / "LOCK").unlink(missing_ok=True)
    warm = Engine.recover(shm / "log", model)
    assert warm.recover_phases["warm_captured"] == 1.0
    st = warm.recovered.streamed["kv"]
    assert st.extra["verify_on_device"] == 1.0 and st.extra["device_verified_pieces"] > 0
    cold = Engine.recover(copy, model, warm_graphs=False)
    assert "warm_captured" not in cold.recover_phases
    assert torch.equal(warm.pool.arena, cold.pool.arena)
    cap = warm.graphs.capture_s
    a, b = warm.step(), cold.step()
    assert warm.graphs.capture_s == cap and warm.graphs.replays == 1  # a replay, no capture at the step
    assert cold.graphs.replays == 1 and cold.graphs.capture_s > 0
    assert a.new_tokens == b.new_tokens and len(a.new_tokens) == 5
    while warm.has_work:
        a, b = warm.step(), cold.step()
        assert a.new_tokens == b.new_tokens
    warm.close()
    cold.close()
