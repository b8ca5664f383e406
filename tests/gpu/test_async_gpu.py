"""Asynchronous epochs over CUDA regions: the snapshot is taken in stream order, so GPU writes launched right
after ``checkpoint_async`` returns (behind a busy GPU, so the snapshot has not even started yet) never reach
the epoch; the log replays exactly the state at each call, and a CPU runtime fed those states finds the same
dirty pages (also for a page set back to the epoch before the one in flight: the next scan compares against
the in-flight epoch). A failed append flags the paged blocks it took again, and the retry logs everything.

Data is fresh random every run (the seed is in every assertion message)."""

from __future__ import annotations

import os
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


def test_lora_on_the_gpu_commits_each_steps_exact_state(tmp_path: Path) -> None:
    """Async LoRA epochs on the GPU: the committed adapter and moments are the bytes right after each step
    (device copies taken after train_step returned, before the next step rewrites them)."""
    pytest.importorskip("peft")
    from concordia_ft.integrations.peft import LoraTrainer, synthetic_batch
    from llm_helpers import VOCAB, tiny_model

    t = LoraTrainer(tiny_model("qwen3").to("cuda"), tmp_path / "log", lr=1e-2)
    assert t.async_checkpoint  # the default
    after: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for k in range(6):
        res = t.train_step(synthetic_batch(k, vocab=VOCAB, device="cuda"))
        after[res.step] = (t.params_flat.clone(), t.adam_flat.clone())
        if res.step == 3:
            assert t.wait() == 3 and res.durable
            rec = cft.recover(tmp_path / "log")
            assert rec.epoch == 3 and rec.meta["concordia.lora"]["step"] == 3
            assert np.array_equal(rec.regions["lora.params"], _host(after[3][0]))
            assert np.array_equal(rec.regions["lora.adam"], _host(after[3][1]))
    assert t.runtime.snapshot_device_bytes >= 3 * t.params_flat.numel() * 4
    t.close()
    assert all(r.durable for r in t.stats.results) and t.committed_step == 6
    rec = cft.recover(tmp_path / "log")
    assert rec.epoch == 6
    assert np.array_equal(rec.regions["lora.params"], _host(after[6][0]))
    assert np.array_equal(rec.regions["lora.adam"], _host(after[6][1]))
