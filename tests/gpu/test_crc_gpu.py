"""The GPU CRC32C (cuda/crc.py) equals the ``crc32c`` package on random device data: odd lengths, odd start
offsets (unaligned first and last words), empty pieces, many pieces in one launch, pieces of several tiles;
and the streamed restore's device sink (cuda/streamed.py) verifies a log's records and refuses a flipped byte."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

crc32c_pkg = pytest.importorskip("crc32c")

from concordia_ft.cuda import crc  # noqa: E402


def test_device_crc32c_equals_crc32c_on_odd_lengths_and_offsets() -> None:
    rng = np.random.default_rng(0)
    host = rng.integers(0, 256, 3 * crc.TILE + 100_000, dtype=np.uint8)
    dev = torch.from_numpy(host).cuda()
    base = int(dev.data_ptr())
    cases = [(0, 0), (1, 1), (3, 7), (5, 255), (8, 256), (13, 257), (1001, 4099), (7, crc.TILE - 1),
             (0, crc.TILE), (9, crc.TILE + 1), (33, 2 * crc.TILE + 12345), (0, 3 * crc.TILE + 99_999)]
    for _ in range(40):  # random ranges inside the buffer
        o = int(rng.integers(0, 5000))
        cases.append((o, int(rng.integers(0, host.size - o))))
    got = crc.crc32c_device([(base + o, n) for o, n in cases])
    want = [crc32c_pkg.crc32c(host[o:o + n].tobytes()) for o, n in cases]
    assert got == want
    host2 = host.copy()
    host2[33 + 70_000] ^= 0x01
    dev.copy_(torch.from_numpy(host2))
    assert crc.crc32c_device([(base + 33, 2 * crc.TILE + 12345)])[0] != want[10]


@pytest.mark.parametrize("slot_bytes", [64 << 10, 1 << 20])
@pytest.mark.parametrize("verify", ["device", "host"])
def test_the_device_sink_verifies_a_log_and_refuses_a_flipped_byte(tmp_path: Path, slot_bytes: int,
                                                                   verify: str) -> None:
    import concordia_ft as cft
    from concordia_ft.core.replay import ReplayOptions, replay
    from concordia_ft.core.streamed import run_streamed
    from concordia_ft.cuda.streamed import CudaSink
    from concordia_ft.errors import LogCorruptError

    page, row, rows = 512, 2048, 96
    log = tmp_path / "log"
    rng = np.random.default_rng(4)
    kv = np.zeros(rows * row, dtype=np.uint8)
    flags = np.zeros(rows, dtype=np.uint8)
    later: set[int] = set()
    with cft.Runtime(log, fsync="never", compact_after_bytes=None, page_bytes=page) as rt:
        rt.register("kv", kv, "paged", block_bytes=row, dirty_blocks=flags, initially_zero=True)
        for step in range(20):
            touched = list(range(0, 30)) if step == 0 else sorted({int(x) for x in rng.choice(rows, 6, replace=False)})
            later.update(touched if step else [])
            for r in touched:
                kv[r * row:(r + 1) * row] = rng.integers(1, 256, row, dtype=np.uint8)
                flags[r] = 1
            rt.checkpoint()

    def restore() -> tuple[torch.Tensor, object]:
        res = replay(log, materialize=False, options=ReplayOptions(defer=("kv",)))
        assert res.pending is not None
        out = torch.full((rows * row,), 0xAB, dtype=torch.uint8, device="cuda")
        sink = CudaSink(out, rows * row, page, slots=3, slot_bytes=slot_bytes, verify=verify)
        plan = res.pending.streamed_plan("kv", sink.slot_bytes)
        try:
            st = run_streamed(plan, sink, threads=2)
        finally:
            sink.close()
            res.close()
        return out, st

    out, st = restore()
    assert np.array_equal(out.cpu().numpy(), kv)
    ex = st.extra  # type: ignore[attr-defined]
    assert ex["verify_on_device"] == float(verify == "device")
    if verify == "device":
        assert ex["device_verified_pieces"] > 0
    assert st.direct_chunks < st.chunks  # type: ignore[attr-defined]  # some chunks went through the scatter
    seg = sorted(log.glob("incr.*.cft"))[0]
    raw = bytearray(seg.read_bytes())
    r = next(r for r in range(30) if r not in later)  # a row written once, at step 0: its bytes are copied
    at = raw.find(bytes(kv[r * row:r * row + 64]))
    assert at >= 0
    raw[at + 100] ^= 0x40
    seg.write_bytes(bytes(raw))
    with pytest.raises(LogCorruptError, match="'kv'.*checksum mismatch"):
        restore()
