"""CPU CI: the probe-cost benchmark's baseline is provably plain. Its workers (experiments/bench_qwen3_probes.py)
each get their own Triton and Inductor caches (``worker_env``); a process that never installs the hook
compiles kernels without probes into its cache, one that installs it compiles them with probes into its own,
and ``triton_hook.scan_cache`` tells them apart. Real Triton compiles for sm_90 (no GPU), one process each."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton", reason="triton not installed")

from concordia_lab.instrument.triton_hook import scan_cache  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
TESTS = Path(__file__).resolve().parent

CHILD = r"""
import sys
sys.path[:0] = [{tests!r}, {exp!r}, {src!r}]
hooked = sys.argv[1] == "1"
if hooked:
    import os
    from concordia_lab.instrument import triton_hook
    from concordia_lab.instrument.safepoints import SafepointOptions
    triton_hook.install(SafepointOptions(), cache_dir=os.environ["TRITON_CACHE_DIR"])
import instrument_kernels as ik
for name in ("poi_silu_mul", "softmax"):
    ptx = ik.compile_for_sm90(name).asm["ptx"]
    print(name, "cft_ctl_" in ptx)
"""


def _bench_module():
    spec = importlib.util.spec_from_file_location("bench_qwen3_probes", ROOT / "experiments" / "bench_qwen3_probes.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_plain_and_instrumented_workers_compile_into_their_own_caches(tmp_path: Path) -> None:
    bench = _bench_module()
    assert bench.VARIANTS["plain"] is None  # the baseline worker never installs the hook
    code = CHILD.format(tests=str(TESTS), exp=str(ROOT / "experiments"), src=str(ROOT / "src"))
    seen = {}
    for variant, hooked in (("plain", "0"), ("probes", "1"), ("plain2", "0")):
        env = bench.worker_env(tmp_path, variant)
        r = subprocess.run([sys.executable, "-c", code, hooked], env=env, capture_output=True, text=True,
                           timeout=600)
        assert r.returncode == 0, r.stderr[-3000:]
        seen[variant] = r.stdout.split()
        cache = env["TRITON_CACHE_DIR"]
        assert cache.startswith(str(tmp_path / variant)) and env["TORCHINDUCTOR_CACHE_DIR"].startswith(
            str(tmp_path / variant))
        c = scan_cache(cache)
        assert c["ptx"] == 2 and c["cubin"] == 2, c
        want = 2 if hooked == "1" else 0
        assert c["ptx_with_probes"] == c["cubin_with_probes"] == want, c
        assert set(c["kernels"]) == {"poi_silu_mul_kernel", "softmax_kernel"}
    assert seen["plain"] == ["poi_silu_mul", "False", "softmax", "False"]
    assert seen["probes"] == ["poi_silu_mul", "True", "softmax", "True"]
    # a plain worker after an instrumented one (fresh caches each): still plain
    assert seen["plain2"] == seen["plain"]
