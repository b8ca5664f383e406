"""Recovery into CUDA regions through page-locked images: the restored tensors equal the CPU replay of the log
byte for byte (fresh random data every run), nothing past a region is written, and the detection state is
re-based on the device so the next checkpoint logs exactly the pages changed after the recovery.

Marker gpu (tests/gpu/conftest.py).
"""

from __future__ import annotations

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import concordia_ft as cft  # noqa: E402
from concordia_ft.cuda.memory import pinned_host_array, reserve_pinned  # noqa: E402

pytestmark = pytest.mark.gpu

PAGE = 4096
GUARD = 4096  # bytes after each region inside its allocation: a restore must never write them
N_BLOCKS, BLOCK = 24, 4 * PAGE


def _layout(rng: np.random.Generator) -> dict[str, tuple[str, int, dict]]:
    """name -> (kind, nbytes, register options). Two hash regions: one with a partial last page."""
    return {
        "kv": ("paged", N_BLOCKS * BLOCK, {"block_bytes": BLOCK}),
        "lora": ("dense", 3 * PAGE // 2 + 7 + 2 * int(rng.integers(0, 100)), {}),
        "hash_tail": ("opaque", 97 * PAGE + 1 + int(rng.integers(0, PAGE - 1)), {"diff": "hash"}),
        "hash_whole": ("opaque", 64 * PAGE, {"diff": "hash"}),
        "shadow": ("opaque", 50 * PAGE + 333, {"diff": "shadow"}),
        "weights": ("immutable", 20 * PAGE + 5, {}),
    }


class Regions:
    """CUDA tensors with GUARD bytes after each region, registered in a Runtime."""

    def __init__(self, rt: cft.Runtime, layout: dict, fill: np.ndarray | int) -> None:
        self.big: dict[str, torch.Tensor] = {}
        self.t: dict[str, torch.Tensor] = {}
        self.flags = torch.zeros(N_BLOCKS, dtype=torch.uint8, device="cuda")
        for name, (kind, nbytes, opts) in layout.items():
            if isinstance(fill, int):
                big = torch.full((nbytes + GUARD,), fill, dtype=torch.uint8, device="cuda")
            else:
                big = torch.from_numpy(fill[: nbytes + GUARD].copy()).cuda()
            self.big[name], self.t[name] = big, big[:nbytes]
            kw = dict(opts)
            if kind == "paged":
                kw["dirty_blocks"] = self.flags
            rt.register(name, self.t[name], kind=kind, **kw)

    def host(self, name: str) -> np.ndarray:
        return self.t[name].cpu().numpy()


def _write_log(log, layout: dict, rng: np.random.Generator) -> None:
    with cft.Runtime(log, fsync="never") as rt:
        r = Regions(rt, layout, rng.integers(0, 256, 128 * PAGE + GUARD, dtype=np.uint8))
        r.flags.fill_(1)
        rt.checkpoint({"epoch": 1})
        for e in range(2, 5):
            for name, (kind, nbytes, _) in layout.items():
                if kind == "immutable":
                    continue
                pos = torch.as_tensor(rng.integers(0, nbytes, 7), device="cuda")
                r.t[name][pos] ^= torch.as_tensor(rng.integers(1, 256, 7, dtype=np.uint8), device="cuda")
            blocks = rng.choice(N_BLOCKS, 3, replace=False)
            for b in blocks:
                r.t["kv"][int(b) * BLOCK : int(b) * BLOCK + 100] = int(rng.integers(0, 256))
                r.flags[int(b)] = 1
            rt.checkpoint({"epoch": e})


@pytest.mark.parametrize("pinned", [True, False])
def test_recover_into_cuda_regions_equals_the_cpu_replay(tmp_path, pinned: bool) -> None:
    seed = int.from_bytes(os.urandom(4), "little")
    rng = np.random.default_rng(seed)
    layout = _layout(rng)
    _write_log(tmp_path / "log", layout, rng)
    ref = cft.recover(tmp_path / "log")  # the CPU reference: host images
    assert ref.epoch == 4
    with cft.Runtime(tmp_path / "log", fsync="never", recovery={"pinned": pinned}) as rt:
        r = Regions(rt, layout, 0xCD)  # garbage where the bytes go
        rec = rt.recover_into()
        for name, (_, nbytes, _) in layout.items():
            assert np.array_equal(r.host(name), ref.regions[name]), f"{name} differs (seed {seed})"
            guard = r.big[name][nbytes:].cpu().numpy()
            assert (guard == 0xCD).all(), f"{name}: a byte past the region was written (seed {seed})"
            img = torch.from_numpy(rec.images[name].padded)
            assert img.is_pinned() == pinned, f"{name}: image pinned={img.is_pinned()}, wanted {pinned}"


def test_after_recovery_the_next_epoch_logs_only_pages_changed_since(tmp_path) -> None:
    seed = int.from_bytes(os.urandom(4), "little")
    rng = np.random.default_rng(seed)
    layout = _layout(rng)
    _write_log(tmp_path / "log", layout, rng)
    with cft.Runtime(tmp_path / "log", fsync="never") as rt:
        r = Regions(rt, layout, 0x11)
        rt.recover_into(keep_images=False)
        rt.checkpoint({"epoch": 5})
        # nothing changed since the restore: only the dense region (rewritten every epoch) is logged
        assert rt.last_stats.region_pages == {"lora": -(-layout["lora"][1] // PAGE)}, f"seed {seed}"
        want: dict[str, int] = {}
        for name in ("hash_tail", "hash_whole", "shadow"):
            nbytes = layout[name][1]
            last = nbytes - 1  # the last page (partial for hash_tail: its hash was computed on the host)
            r.t[name][last] ^= 0xFF
            r.t[name][5] ^= 0x01  # and the first
            want[name] = 2
        r.t["kv"][7 * BLOCK] ^= 0xFF
        r.flags[7] = 1
        want["kv"] = BLOCK // PAGE
        want["lora"] = -(-layout["lora"][1] // PAGE)
        rt.checkpoint({"epoch": 6})
        assert rt.last_stats.region_pages == want, f"seed {seed}"
        expected = {n: r.host(n) for n in layout}
    rec = cft.recover(tmp_path / "log")
    assert rec.epoch == 6
    for name in layout:
        assert np.array_equal(rec.regions[name], expected[name]), f"{name} (seed {seed})"


def test_pinned_host_array_is_page_locked_writable_and_kept_alive() -> None:
    reserve_pinned(4 * PAGE)  # leaves a block in torch's pinned cache; the next array may reuse it
    a = pinned_host_array(3 * PAGE + 1)
    assert a.dtype == np.uint8 and a.nbytes == 3 * PAGE + 1 and a.flags.writeable
    assert torch.from_numpy(a).is_pinned()
    view = a[PAGE:]
    del a  # the view keeps the pinned block alive
    view[:] = 7
    assert (view == 7).all()
