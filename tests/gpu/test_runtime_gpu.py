"""Runtime over CUDA tensors: the GPU handlers' logs equal the CPU backend's byte for byte, and recovery
restores GPU tensors exactly (in place and in a fresh process)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import concordia_ft as cft  # noqa: E402

PAGE = 4096


def _regions(seed: int) -> dict[str, tuple[str, torch.Tensor, dict]]:
    g = torch.Generator().manual_seed(seed)
    n_blocks, block_bytes = 24, 4 * PAGE
    return {
        "kv": ("paged", torch.randint(0, 255, (n_blocks * block_bytes,), generator=g, dtype=torch.uint8),
               {"block_bytes": block_bytes, "n_blocks": n_blocks}),
        "lora": ("dense", torch.randn(3 * PAGE // 2 + 7, generator=g).to(torch.bfloat16), {}),
        "state_h": ("opaque", torch.randn(100_003, generator=g), {"diff": "hash"}),
        "state_s": ("opaque", torch.randn(100_003, generator=g), {"diff": "shadow"}),
        "weights": ("immutable", torch.randn(50_000, generator=g).to(torch.float16), {}),
    }


def _register(rt: cft.Runtime, regions: dict, device: str) -> tuple[dict, torch.Tensor]:
    bufs = {}
    bitmap = None
    for name, (kind, host, opts) in regions.items():
        t = host.clone().to(device)
        kw = {k: v for k, v in opts.items() if k != "n_blocks"}
        if kind == "paged":
            bitmap = torch.zeros(opts["n_blocks"], dtype=torch.uint8, device=device)
            kw["dirty_blocks"] = bitmap
        rt.register(name, t, kind=kind, **kw)
        bufs[name] = t
    return bufs, bitmap


def _mutate(bufs: dict, bitmap: torch.Tensor, rng: np.random.Generator) -> None:
    kv = bufs["kv"]
    for blk in rng.choice(bitmap.numel(), size=3, replace=False):
        start = int(blk) * kv.numel() // bitmap.numel()
        kv[start : start + 100] = torch.randint(0, 255, (100,), dtype=torch.uint8, device=kv.device)
        bitmap[int(blk)] = 1
    bufs["lora"].add_(torch.randn_like(bufs["lora"]))
    for name in ("state_h", "state_s"):
        idx = torch.as_tensor(rng.choice(bufs[name].numel(), size=5, replace=False), device=bufs[name].device)
        bufs[name][idx] += 1.0
        bufs[name][-1] += 1.0  # the tail page (region not a whole number of pages)


def test_gpu_runtime_log_equals_cpu_runtime_log(tmp_path) -> None:
    regions = _regions(1)
    rt_gpu = cft.Runtime(tmp_path / "gpu", fsync="never")
    rt_cpu = cft.Runtime(tmp_path / "cpu", fsync="never")
    gbufs, gmap = _register(rt_gpu, regions, "cuda")
    cbufs, cmap = _register(rt_cpu, regions, "cpu")
    rng_g = np.random.default_rng(7)
    for step in range(6):
        if step:
            torch.manual_seed(step)
            _mutate(gbufs, gmap, rng_g)
            cpu_ref = {k: v.to("cpu") for k, v in gbufs.items()}  # the CPU run gets the GPU's exact bytes
            for k in cbufs:
                cbufs[k].copy_(cpu_ref[k])
            cmap.copy_(gmap.cpu())
        rt_gpu.checkpoint(meta={"step": step})
        rt_cpu.checkpoint(meta={"step": step})
        assert rt_gpu.last_stats.region_pages == rt_cpu.last_stats.region_pages, step
        assert int(gmap.sum()) == 0 and int(cmap.sum()) == 0  # committed blocks cleared
    rt_gpu.close()
    rt_cpu.close()
    rg, rc = cft.recover(tmp_path / "gpu"), cft.recover(tmp_path / "cpu")
    assert rg.epoch == rc.epoch == 6 and rg.meta == rc.meta == {"step": 5}
    for name in regions:
        assert np.array_equal(rg.regions[name], rc.regions[name]), name
        want = gbufs[name].cpu().contiguous().view(torch.uint8).numpy().reshape(-1)
        assert np.array_equal(rg.regions[name], want), name


def test_gpu_recover_into_and_fresh_process(tmp_path) -> None:
    regions = _regions(2)
    rt = cft.Runtime(tmp_path / "log", fsync="always")
    bufs, bitmap = _register(rt, regions, "cuda")
    rt.checkpoint()
    _mutate(bufs, bitmap, np.random.default_rng(3))
    rt.checkpoint()
    want = {k: v.clone() for k, v in bufs.items()}
    rt.close()
    # in place, on the GPU, after the buffers were trashed
    rt2 = cft.Runtime(tmp_path / "log")
    fresh = {k: torch.full_like(v, 3) for k, v in want.items()}
    for name, (kind, _, opts) in regions.items():
        kw = {k: v for k, v in opts.items() if k != "n_blocks"}
        if kind == "paged":
            kw["dirty_blocks"] = torch.zeros(opts["n_blocks"], dtype=torch.uint8, device="cuda")
        rt2.register(name, fresh[name], kind=kind, **kw)
    rec = rt2.recover_into()
    assert rec.epoch == 2
    for name in want:
        assert torch.equal(fresh[name].view(torch.uint8), want[name].view(torch.uint8)), name
    rt2.checkpoint()  # after a full restore the next epoch is a delta: only the dense region is rewritten
    assert rt2.last_stats.region_pages == {"lora": 4}, rt2.last_stats
    rt2.close()
    # a fresh process restores onto its GPU from the log alone
    code = textwrap.dedent(f"""
        import torch, concordia_ft as cft
        rec = cft.recover({str(tmp_path / "log")!r})
        t = rec.tensor("state_h", device="cuda")
        print(rec.epoch, float(t.double().sum()))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    epoch, total = out.stdout.split()
    assert int(epoch) == 3 and float(total) == pytest.approx(float(want["state_h"].double().sum()), rel=0, abs=1e-6)
