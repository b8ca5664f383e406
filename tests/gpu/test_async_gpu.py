"""Asynchronous epochs over CUDA regions: the snapshot is taken in stream order, so GPU writes launched right
after ``checkpoint_async`` returns (behind a busy GPU, so the snapshot has not even started yet) never reach
the epoch; the log replays exactly the state at each call, and a CPU runtime fed those states finds the same
dirty pages (also for a page set back to the epoch before the one in flight: the next scan compares against
the in-flight epoch). A failed append flags the paged blocks it took again, and the retry logs everything.

Data is fresh random every run (the seed is in every assertion message)."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import concordia_ft as cft  # noqa: E402
from concordia_ft.errors import CheckpointError  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from faults import FaultyLog  # noqa: E402

pytestmark = pytest.mark.gpu

PAGE = 4096
N_BLOCKS, BLOCK = 24, 2 * PAGE
BUSY_CYCLES = 40_000_000  # ~20 ms of GPU spin: the snapshot is queued behind it when the call returns


def _seed() -> int:
    return int.from_bytes(os.urandom(4), "little")


class GpuRegions:
    """Dense (bf16, not a page multiple), opaque hash and shadow (tail pages), paged with CUDA flags, immutable."""

    def __init__(self, seed: int, device: str = "cuda") -> None:
        g = torch.Generator().manual_seed(seed)
        self.t = {
            "dense": torch.randn(3 * PAGE // 2 + 7, generator=g).to(torch.bfloat16),
            "hash": torch.randn(200_003, generator=g),
            "shadow": torch.randn(100_003, generator=g),
            "kv": torch.randint(0, 255, (N_BLOCKS * BLOCK,), generator=g, dtype=torch.uint8),
            "imm": torch.randn(50_000, generator=g).to(torch.float16),
        }
        self.t = {k: v.to(device) for k, v in self.t.items()}
        self.flags = torch.zeros(N_BLOCKS, dtype=torch.uint8, device=device)
        self.flagged: set[int] = set()  # blocks flagged since the last call (the CPU twin's flags)
        self.rng = np.random.default_rng(seed)

    def register(self, rt: cft.Runtime) -> None:
        rt.register("dense", self.t["dense"], "dense")
        rt.register("hash", self.t["hash"], "opaque", diff="hash")
        rt.register("shadow", self.t["shadow"], "opaque", diff="shadow")
        rt.register("kv", self.t["kv"], "paged", block_bytes=BLOCK, dirty_blocks=self.flags)
        rt.register("imm", self.t["imm"], "immutable")

    def write(self) -> None:
        """In-place GPU writes, all on the current stream, no host sync: random pages of every mutable region."""
        r = self.rng
        self.t["dense"].neg_()  # flips every element's sign bit: every page changes
        for name in ("hash", "shadow"):
            t = self.t[name]
            idx = torch.as_tensor(r.choice(t.numel(), size=int(r.integers(1, 6)), replace=False), device=t.device)
            t[idx] += 1.0
            if r.random() < 0.5:
                t[-1] -= 2.0  # the tail page
        for b in r.choice(N_BLOCKS, size=int(r.integers(1, 4)), replace=False):
            lo = int(b) * BLOCK + int(r.integers(0, BLOCK - 64))
            self.t["kv"][lo: lo + 64] = torch.randint(0, 255, (64,), dtype=torch.uint8, device=self.flags.device)
            self.flags[int(b)] = 1
            self.flagged.add(int(b))

    def copies(self) -> dict[str, torch.Tensor]:
        """Device copies of every region, in stream order (no host sync)."""
        return {k: v.clone() for k, v in self.t.items()}


def _host(t: torch.Tensor) -> np.ndarray:
    return t.detach().cpu().contiguous().view(torch.uint8).numpy().reshape(-1)


def test_writes_launched_after_the_call_never_reach_the_epoch(shm_dir: Path) -> None:
    seed = _seed()
    regs = GpuRegions(seed)
    rt = cft.Runtime(shm_dir / "gpu", fsync="never", compact_after_bytes=None)
    regs.register(rt)
    assert rt.snapshot_device_bytes == 0  # nothing until the first async epoch
    states: list[dict[str, torch.Tensor]] = []
    flagged: list[set[int]] = []
    handles = []
    for step in range(8):
        if step:
            regs.write()
        torch.cuda._sleep(BUSY_CYCLES)  # keep the stream busy: the call returns long before the snapshot runs
        states.append(regs.copies())
        flagged.append(regs.flagged)
        regs.flagged = set()
        handles.append(rt.checkpoint_async({"step": step}))
        regs.write()  # launched right after the call returned: must land in the NEXT epoch
        if step:  # page 0 back to the epoch BEFORE the in-flight one: it differs from the in-flight epoch only
            for name in ("hash", "shadow"):
                regs.t[name][:1024].copy_(states[step - 1][name][:1024])
        if step % 3 == 2:
            assert handles[-1].wait() == step + 1
            rec = cft.recover(shm_dir / "gpu")  # a reader, while the writer is open
            for name, want in states[-1].items():
                assert np.array_equal(rec.regions[name], _host(want)), (seed, step, name)
    padded = sum(-(-t.numel() * t.element_size() // PAGE) * PAGE for n, t in regs.t.items() if n != "imm")
    assert rt.snapshot_device_bytes == padded + N_BLOCKS, seed  # reported: the device cost of the snapshots
    gpu_pages = []
    for h in handles:
        h.wait()
        gpu_pages.append(h.stats.region_pages)
        assert h.stats.mode == "async" and h.stats.snapshot_device_bytes == rt.snapshot_device_bytes
    rt.close()
    rec = cft.recover(shm_dir / "gpu")
    assert rec.epoch == 8 and rec.meta == {"step": 7}
    for name, want in states[-1].items():
        assert np.array_equal(rec.regions[name], _host(want)), (seed, name)
    # a CPU runtime fed the same states (and the same flags) in sync epochs logs the same pages
    cpu = {n: t.cpu().clone() for n, t in states[0].items()}
    cflags = torch.zeros(N_BLOCKS, dtype=torch.uint8)
    rt_cpu = cft.Runtime(shm_dir / "cpu", fsync="never", compact_after_bytes=None)
    rt_cpu.register("dense", cpu["dense"], "dense")
    rt_cpu.register("hash", cpu["hash"], "opaque", diff="hash")
    rt_cpu.register("shadow", cpu["shadow"], "opaque", diff="shadow")
    rt_cpu.register("kv", cpu["kv"], "paged", block_bytes=BLOCK, dirty_blocks=cflags)
    rt_cpu.register("imm", cpu["imm"], "immutable")
    for step, (state, blocks) in enumerate(zip(states, flagged, strict=True)):
        for name, t in state.items():
            cpu[name].copy_(t.cpu())
        cflags[sorted(blocks)] = 1
        rt_cpu.checkpoint({"step": step})
        assert rt_cpu.last_stats.region_pages == gpu_pages[step], (seed, step)
    rt_cpu.close()
    rc = cft.recover(shm_dir / "cpu")
    for name in rec.regions:
        assert np.array_equal(rec.regions[name], rc.regions[name]), (seed, name)


def test_a_failed_async_epoch_flags_its_blocks_again_and_the_retry_logs_everything(shm_dir: Path) -> None:
    seed = _seed()
    regs = GpuRegions(seed)
    rt = cft.Runtime(shm_dir / "log", fsync="never", compact_after_bytes=None)
    regs.register(rt)
    rt.checkpoint_async({"step": 0}).wait()
    regs.flagged = set()
    regs.write()
    rt.log = faulty = FaultyLog(rt.log, delay_s=1.0, delay_epochs={2}, fail_epochs={2})
    h = rt.checkpoint_async({"step": 1})
    torch.cuda.synchronize()
    assert int(regs.flags.sum()) == 0 and not h.done(), seed  # the stage took the flags (copied + cleared)
    with pytest.raises(CheckpointError, match="epochs up to 1 are committed"):
        h.wait()
    want_blocks = sorted(regs.flagged)
    assert torch.nonzero(regs.flags).flatten().tolist() == want_blocks, seed  # given back
    state = regs.copies()
    faulty.fail_epochs.clear()
    h = rt.checkpoint_async({"step": 1})
    assert h.wait() == 2
    assert h.stats.region_pages["kv"] == 2 * len(want_blocks), seed
    assert {"hash", "shadow", "dense"} <= set(h.stats.region_pages), seed
    rt.close()
    rec = cft.recover(shm_dir / "log")
    for name, want in state.items():
        assert np.array_equal(rec.regions[name], _host(want)), (seed, name)


def test_dense_regions_of_a_device_are_one_batch_and_adjacent_ones_share_a_copy(shm_dir: Path) -> None:
    """The dense CUDA regions of a runtime are staged as ONE batch: slices of one arena that are whole pages
    and adjacent share one D2D copy (as LoRA's adapter and moments do), a region that is not whole pages ends
    that copy, a region after its pad or elsewhere has its own. The snapshot is still the state at the call:
    writes queued right after it, behind a busy GPU, never reach the epoch; every epoch replays exactly and
    logs the pages a CPU runtime logs for the same states."""
    seed = _seed()
    g = torch.Generator().manual_seed(seed)
    f = PAGE // 4  # float32 elements per page
    arena = torch.randn(2 * f + 3 * f + 1000 + f, generator=g).to("cuda")
    t = {"a": arena[: 2 * f], "b": arena[2 * f: 5 * f],  # 2 and 3 whole pages, adjacent
         "c": arena[5 * f: 5 * f + 1000],  # 4000 bytes: ends the shared copy (its pad is not arena bytes)
         "d": arena[5 * f + 1000:],  # right after c in memory, after c's pad in the snapshot: its own copy
         "e": torch.randn(777, generator=g).to(torch.bfloat16).to("cuda"),  # another allocation
         "hash": torch.randn(50_003, generator=g).to("cuda")}
    rt = cft.Runtime(shm_dir / "gpu", fsync="never", compact_after_bytes=None)
    for name, buf in t.items():
        rt.register(name, buf, "opaque" if name == "hash" else "dense")
    states, handles = [], []
    for step in range(5):
        arena.mul_(-1.5).add_(step)
        t["e"].add_(1.0)
        t["hash"][int(step * 1000)] += 1.0
        torch.cuda._sleep(BUSY_CYCLES)
        states.append({k: v.clone() for k, v in t.items()})
        handles.append(rt.checkpoint_async({"step": step}))
        arena.neg_()  # queued behind the busy GPU, after the snapshot: the next epoch's
        t["e"].zero_()
        if step % 2:
            assert handles[-1].wait() == step + 1
            rec = cft.recover(shm_dir / "gpu")
            for name, want in states[-1].items():
                assert np.array_equal(rec.regions[name], _host(want)), (seed, step, name)
        arena.neg_()
        t["e"].copy_(states[-1]["e"])
    batches = [b for _, _, b in rt._plan.batches]
    assert [type(b).__name__ for b in batches] == ["CudaDenseBatch"] and len(batches[0].specs) == 5
    copies = batches[0].copies
    assert len(copies) == 3, copies  # a+b+c, d, e
    assert (PAGE * 2 + PAGE * 3 + 4000) in [n for _, _, n in copies]
    dense_padded = sum(-(-v.numel() * v.element_size() // PAGE) * PAGE for k, v in t.items() if k != "hash")
    assert batches[0].snapshot_device_bytes == dense_padded
    hash_padded = -(-t["hash"].numel() * 4 // PAGE) * PAGE
    assert rt.snapshot_device_bytes == dense_padded + hash_padded, seed  # + the opaque region's snapshot
    for h in handles:
        h.wait()
        assert h.stats.region_pages["c"] == 1 and h.stats.region_pages["a"] == 2, seed
    rt.close()
    rec = cft.recover(shm_dir / "gpu")
    assert rec.epoch == 5
    for name, want in states[-1].items():
        assert np.array_equal(rec.regions[name], _host(want)), (seed, name)


def test_lora_on_the_gpu_commits_each_steps_exact_state(tmp_path: Path) -> None:
    """Async LoRA epochs on the GPU: the committed adapter, moments and lora.state (AdamW's step counters, the
    CPU RNG state) are the bytes right after each step (copies taken after train_step returned, before the next
    step rewrites them). The adapter and moments are one arena: ONE D2D copy per step."""
    pytest.importorskip("peft")
    from concordia_ft.integrations.peft import LoraTrainer, synthetic_batch
    from llm_helpers import VOCAB, tiny_model

    t = LoraTrainer(tiny_model("qwen3").to("cuda"), tmp_path / "log", lr=1e-2)
    assert t.async_checkpoint  # the default
    after: dict[int, tuple[torch.Tensor, torch.Tensor, np.ndarray]] = {}
    for k in range(6):
        res = t.train_step(synthetic_batch(k, vocab=VOCAB, device="cuda"))
        after[res.step] = (t.params_flat.clone(), t.adam_flat.clone(), t.state_flat.numpy().copy())
        if res.step == 3:
            assert t.wait() == 3 and res.durable
            rec = cft.recover(tmp_path / "log")
            assert rec.epoch == 3 and rec.meta["concordia.lora"]["step"] == 3
            assert np.array_equal(rec.regions["lora.params"], _host(after[3][0]))
            assert np.array_equal(rec.regions["lora.adam"], _host(after[3][1]))
            assert np.array_equal(rec.regions["lora.state"], after[3][2])
    device_batches = [b for _, _, b in t.runtime._plan.batches if type(b).__name__ == "CudaDenseBatch"]
    assert len(device_batches) == 1 and len(device_batches[0].copies) == 1  # params + moments: one copy
    assert t.runtime.snapshot_device_bytes >= 3 * t.params_flat.numel() * 4
    t.close()
    assert all(r.durable for r in t.stats.results) and t.committed_step == 6
    rec = cft.recover(tmp_path / "log")
    assert rec.epoch == 6 and sorted(rec.regions) == ["lora.adam", "lora.cuda_rng", "lora.params", "lora.state"]
    assert np.array_equal(rec.regions["lora.params"], _host(after[6][0]))
    assert np.array_equal(rec.regions["lora.adam"], _host(after[6][1]))
    assert np.array_equal(rec.regions["lora.state"], after[6][2])
    n = len(t.param_names)
    assert (rec.regions["lora.state"][: 4 * n].view(np.float32) == 6).all()


def _eager_model(family: str) -> torch.nn.Module:
    """The tiny model on the GPU with eager attention (plain matmuls: the same arithmetic on every run)."""
    from llm_helpers import tiny_model

    m = tiny_model(family)
    m.set_attn_implementation("eager")
    return m.to("cuda")


def test_lora_on_the_gpu_resumes_with_the_same_losses(tmp_path: Path) -> None:
    """Recovered onto a fresh GPU model (lora.params and lora.adam restored into the CUDA arena, lora.state
    into host memory), training continues with the losses of an uninterrupted run, bit for bit; a log of the
    layout before lora.state (tests/data/lora-layout1, written on a CPU) restores onto the GPU too."""
    pytest.importorskip("peft")
    from concordia_ft.integrations.peft import LoraTrainer, default_lora_config, synthetic_batch
    from llm_helpers import LAYOUT1_LORA, LAYOUT1_LR, LAYOUT1_STEPS, VOCAB

    def batch(k: int) -> dict[str, torch.Tensor]:
        return synthetic_batch(k, vocab=VOCAB, device="cuda")

    steps, cut = 6, 3
    with LoraTrainer(_eager_model("qwen3"), tmp_path / "ref", lr=1e-2) as ref:
        ref_losses = [r.loss for r in ref.train(batch, steps)]
    with LoraTrainer(_eager_model("qwen3"), tmp_path / "log", lr=1e-2) as t:
        t.train(batch, cut)
    t = LoraTrainer.recover(tmp_path / "log", _eager_model("qwen3"), lr=1e-2)
    assert t.params_flat.is_cuda and t.step == cut
    resumed = [r.loss for r in t.train(batch, steps)]
    t.close()
    assert resumed == ref_losses[cut:]
    assert len(set(ref_losses)) == steps

    log1 = tmp_path / "layout1"
    shutil.copytree(Path(__file__).resolve().parents[1] / "data" / "lora-layout1", log1)
    old = cft.recover(log1)
    t = LoraTrainer.recover(log1, _eager_model("qwen3"), lora_config=default_lora_config(**LAYOUT1_LORA),
                            lr=LAYOUT1_LR)
    assert t.step == LAYOUT1_STEPS
    assert np.array_equal(_host(t.params_flat), old.regions["lora.params"])
    assert np.array_equal(_host(t.adam_flat), old.regions["lora.adam"])
    assert t.steps_flat.numpy().tobytes() == old.regions["lora.steps"].tobytes()
    t.train(batch, LAYOUT1_STEPS + 1)
    t.close()
    # continues in the current layout: lora.state, and the GPU's RNG state logged in full by the next epoch
    assert sorted(cft.recover(log1).regions) == ["lora.adam", "lora.cuda_rng", "lora.params", "lora.state"]


def test_lora_dropout_on_the_gpu_resumes_with_the_same_losses(tmp_path: Path) -> None:
    """Dropout on the GPU draws from the device's RNG: recovery restores it (lora.cuda_rng), so the resumed
    losses equal the uninterrupted run's even though this process's generator was moved elsewhere first; the
    same recovery with the generator left where it was gives other losses (what the region is for)."""
    pytest.importorskip("peft")
    from concordia_ft.integrations.peft import LoraTrainer, default_lora_config, synthetic_batch
    from llm_helpers import VOCAB

    def batch(k: int) -> dict[str, torch.Tensor]:
        return synthetic_batch(k, vocab=VOCAB, device="cuda")

    def cfg() -> object:
        return default_lora_config(dropout=0.2)

    steps, cut = 6, 3
    torch.manual_seed(7)
    with LoraTrainer(_eager_model("qwen3"), tmp_path / "ref", lora_config=cfg(), lr=1e-2) as ref:
        ref_losses = [r.loss for r in ref.train(batch, steps)]
    torch.manual_seed(7)
    with LoraTrainer(_eager_model("qwen3"), tmp_path / "log", lora_config=cfg(), lr=1e-2) as t:
        t.train(batch, cut)
    shutil.copytree(tmp_path / "log", tmp_path / "log2")
    torch.cuda.manual_seed(12345)  # as in a fresh process: the device's generator is not where the run left it
    t = LoraTrainer.recover(tmp_path / "log", _eager_model("qwen3"), lora_config=cfg(), lr=1e-2)
    resumed = [r.loss for r in t.train(batch, steps)]
    t.close()
    assert resumed == ref_losses[cut:]
    t = LoraTrainer.recover(tmp_path / "log2", _eager_model("qwen3"), lora_config=cfg(), lr=1e-2)
    torch.cuda.manual_seed(12345)  # undo the restore: the dropout masks differ
    other = [r.loss for r in t.train(batch, steps)]
    t.close()
    assert other != ref_losses[cut:]


def test_async_epochs_dma_snapshots_straight_into_the_mapped_dram_log(shm_dir: Path) -> None:
    """A mapped DRAM log: asynchronous epochs hand the log their device snapshots (dense batch members, a
    paged gather, an opaque region's full and listed snapshots), which it DMAs into its own pages: no pinned
    staging buffer is ever allocated for them, and every epoch replays to exactly the state at its call."""
    seed = _seed()
    g = torch.Generator(device="cuda").manual_seed(seed)
    n_blocks = 256
    t = {
        "adapter": torch.randn((1 << 20) + 3, device="cuda", generator=g),  # 4 MiB + 12 bytes: a padded tail
        "moments": torch.randn(1 << 19, device="cuda", generator=g),
        "small": torch.randn(1000, device="cuda", generator=g),  # under the DMA threshold: staged
        "opaque": torch.randn(1 << 19, device="cuda", generator=g),
        "kv": torch.randint(0, 255, (n_blocks * BLOCK,), device="cuda", generator=g, dtype=torch.uint8),
    }
    flags = torch.zeros(n_blocks, dtype=torch.uint8, device="cuda")
    rt = cft.Runtime(shm_dir / "log", fsync="never", backend="dram", compact_after_bytes=None,
                     log_options={"mapped_segment_bytes": 16 << 20})
    for name in ("adapter", "moments", "small"):
        rt.register(name, t[name], "dense")
    rt.register("opaque", t["opaque"], "opaque", diff="hash")
    rt.register("kv", t["kv"], "paged", block_bytes=BLOCK, dirty_blocks=flags)
    assert rt.log.accepts_placed
    r = np.random.default_rng(seed)
    states = []
    for step in range(6):
        if step:
            t["adapter"].mul_(1.5)
            t["moments"].add_(1.0)
            t["small"].neg_()
            idx = torch.as_tensor(r.choice(t["opaque"].numel() // 1024, size=100, replace=False) * 1024,
                                  device="cuda")
            t["opaque"][idx] += 1.0  # 100 pages: a listed snapshot over the DMA threshold
            blocks = r.choice(n_blocks, size=40, replace=False)
            for b in blocks:
                t["kv"][int(b) * BLOCK: int(b) * BLOCK + 100] = torch.randint(
                    0, 255, (100,), dtype=torch.uint8, device="cuda", generator=g)
            flags[torch.as_tensor(blocks, device="cuda")] = 1
        states.append({k: v.clone() for k, v in t.items()})
        h = rt.checkpoint_async({"step": step})
        if step % 2:
            h.wait()
            rec = cft.recover(shm_dir / "log")
            for name, want in states[-1].items():
                assert np.array_equal(rec.regions[name], _host(want)), (seed, step, name)
    h.wait()
    for name in ("adapter", "moments", "opaque", "kv"):
        assert rt._trackers[name]._payload is None, (seed, name)  # never staged through pinned memory
    assert rt._trackers["small"]._payload is not None
    rt.close()
    rec = cft.recover(shm_dir / "log")
    assert rec.epoch == 6
    for name, want in states[-1].items():
        assert np.array_equal(rec.regions[name], _host(want)), (seed, name)


def test_large_async_epochs_roll_into_prepared_spares_and_replay_exact(shm_dir: Path) -> None:
    """24 MiB dense epochs (gated DMA chunks) into 32 MiB mapped segments: the segment worker keeps the next
    segment ready (sized from the epochs seen, registered, faulted in), so the epochs that roll take it; the DMA
    time the GPU's events measure is part of the wait; every recovered state is exactly the one at its call."""
    seed = _seed()
    g = torch.Generator(device="cuda").manual_seed(seed)
    a = torch.randn(6 << 20, device="cuda", generator=g)
    rt = cft.Runtime(shm_dir / "log", fsync="never", backend="dram", compact_after_bytes=None,
                     log_options={"mapped_segment_bytes": 32 << 20})
    rt.register("a", a, "dense")
    phases = []
    for step in range(8):
        if step:
            a.mul_(1.01).add_(torch.randn(a.numel(), device="cuda", generator=g))
        want = _host(a.clone())
        rt.checkpoint_async({"step": step}).wait()
        phases.append(dict(rt.log.last_placed_phases))
        if step in (3, 7):
            rec = cft.recover(shm_dir / "log")
            assert rec.epoch == step + 1 and np.array_equal(rec.regions["a"], want), (seed, step)
    spare = rt.log._spare
    assert spare is not None and spare.ahead and spare.stats["made"] >= 2, (seed, spare and spare.stats)
    assert len(rt.log.manifest.incr) >= 3  # it rolled
    for p in phases[1:]:
        assert p["gated"] == 1.0 and p["registered"] == 1.0, (seed, p)
        assert 0 < p["dma"] <= p["place"] + p["wait"] + 1e-3, (seed, p)
    rt.close()
    rec = cft.recover(shm_dir / "log")
    assert rec.epoch == 8 and np.array_equal(rec.regions["a"], want), seed
