"""CPU CI: render and NVRTC-compile every handler for sm_90, the compile cache, CompileError, lazy import.

Needs only NVRTC (the nvidia-cuda-nvrtc wheel), no GPU. Skips only when NVRTC itself is absent.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from concordia_ft.core.regions import RegionKind, RegionSpec
from concordia_ft.errors import CompileError

nvrtc_mod = pytest.importorskip("cuda.bindings.nvrtc", reason="cuda-bindings not installed")

from concordia_ft.cuda import handlers, nvrtc  # noqa: E402

SRC = Path(__file__).resolve().parents[1] / "src"

GEOMETRIES = [
    RegionSpec("opaque_4k", RegionKind.OPAQUE, 256 << 20),
    RegionSpec("opaque_tail", RegionKind.OPAQUE, 12345, page_bytes=512),
    RegionSpec("opaque_odd", RegionKind.OPAQUE, 3 * 4096 + 7),
    RegionSpec("opaque_64k", RegionKind.OPAQUE, (1 << 20) + 100, page_bytes=65536),
    RegionSpec("paged", RegionKind.PAGED, 64 * 65536, page_bytes=8192, block_bytes=65536),
    RegionSpec("dense", RegionKind.DENSE, 1000, page_bytes=4096),
]


@pytest.fixture(autouse=True)
def _cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("CONCORDIA_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.mark.parametrize("spec", GEOMETRIES, ids=lambda s: s.name)
def test_every_handler_compiles_for_sm90(spec: RegionSpec) -> None:
    src = handlers.render_handlers(spec)
    assert f"#define CFT_PAGE_BYTES {spec.page_bytes}u" in src
    assert f"#define CFT_N_PAGES {spec.n_pages}ull" in src
    mod = handlers.compile_handlers(spec, "sm_90")
    assert mod.cubin.startswith(b"\x7fELF")
    for k in handlers.KERNELS:  # every kernel is exported under its extern "C" name
        assert k.encode() + b"\0" in mod.cubin, k


def test_same_geometry_shares_source_and_name_does_not_matter() -> None:
    a = RegionSpec("a", RegionKind.OPAQUE, 5000)
    b = RegionSpec("b", RegionKind.OPAQUE, 5000, diff=a.diff)
    assert handlers.render_handlers(a) == handlers.render_handlers(b)
    assert handlers.render_handlers(a) != handlers.render_handlers(RegionSpec("c", RegionKind.OPAQUE, 5001))


def test_cache_miss_then_hit_and_key_covers_arch_and_options(_cache: Path) -> None:
    src = 'extern "C" __global__ void concordia_k(int* x) { x[threadIdx.x] += 1; }'
    first = nvrtc.compile_cubin(src, "k")
    assert not first.cache_hit and first.path is not None and first.path.is_file()
    assert first.path.parent.parent == _cache  # under the cache dir, never inside the package
    second = nvrtc.compile_cubin(src, "k")
    assert second.cache_hit and second.cubin == first.cubin
    other_arch = nvrtc.compile_cubin(src, "k", nvrtc.CompileOptions(arch="sm_80"))
    assert not other_arch.cache_hit and other_arch.key != first.key
    other_opt = nvrtc.compile_cubin(src, "k", nvrtc.CompileOptions(defines=(("X", "1"),)))
    assert other_opt.key != first.key
    assert len({p.name for p in (_cache / "cubin").iterdir()}) == 3
    assert not list((_cache / "cubin").glob("*.tmp"))


def test_corrupt_cache_entry_is_recompiled(_cache: Path) -> None:
    src = 'extern "C" __global__ void concordia_k2() {}'
    first = nvrtc.compile_cubin(src, "k2")
    assert first.path is not None
    first.path.write_bytes(b"garbage")
    again = nvrtc.compile_cubin(src, "k2")
    assert not again.cache_hit and again.cubin == first.cubin
    assert first.path.read_bytes() == first.cubin


def test_concurrent_writers_of_one_key_leave_one_whole_cubin(_cache: Path) -> None:
    src = 'extern "C" __global__ void concordia_k3(float* x) { x[0] *= 2.0f; }'
    results: list[bytes] = []
    errors: list[BaseException] = []

    def work() -> None:
        try:
            results.append(nvrtc.compile_cubin(src, "k3").cubin)
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    files = list((_cache / "cubin").iterdir())
    assert len(files) == 1 and files[0].read_bytes() == results[0]
    assert all(r == results[0] for r in results)


def test_threads_compiling_at_once_run_nvrtc_once_per_key(_cache: Path) -> None:
    """8 threads released together ask for 2 keys: NVRTC runs exactly twice, every thread gets its key's
    cubin, the first to finish compiled it and the others read it from the cache."""
    sources = [f'extern "C" __global__ void concordia_c{i}(float* x) {{ x[threadIdx.x] *= {i + 2}.0f; }}'
               for i in range(2)]
    before = nvrtc.stats["compiles"]
    start = threading.Barrier(8)
    got: dict[int, list[nvrtc.CompiledModule]] = {0: [], 1: []}
    errors: list[BaseException] = []

    def work(i: int) -> None:
        try:
            start.wait()
            got[i % 2].append(nvrtc.compile_cubin(sources[i % 2], f"c{i % 2}"))
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert nvrtc.stats["compiles"] - before == 2
    for mods in got.values():
        assert len(mods) == 4 and len({m.cubin for m in mods}) == 1
        assert sum(not m.cache_hit for m in mods) == 1
    assert got[0][0].cubin != got[1][0].cubin
    assert len(list((_cache / "cubin").iterdir())) == 2


def test_bad_source_raises_compile_error_with_log() -> None:
    with pytest.raises(CompileError) as ei:
        nvrtc.compile_cubin('extern "C" __global__ void concordia_bad() { int x = ; }', "bad")
    assert ei.value.name == "bad"
    assert "expected an expression" in ei.value.log
    assert "sm_90" in ei.value.log  # the options are part of the report
    assert not (Path(os.environ["CONCORDIA_CACHE_DIR"]) / "cubin").exists() or not list(
        (Path(os.environ["CONCORDIA_CACHE_DIR"]) / "cubin").iterdir())


def test_cuda_headers_are_found_for_cuda_atomic() -> None:
    try:
        dirs = nvrtc.find_cuda_include_dirs()
    except Exception as e:  # ConfigError names what is missing; that is the behaviour under test
        assert "missing" in str(e)
        pytest.skip(f"no CUDA headers on this machine: {e}")
    assert any(Path(d, "cuda_runtime.h").is_file() for d in dirs)
    src = '#include <cuda/atomic>\nextern "C" __global__ void concordia_a(int* x) {\n' \
          '  cuda::atomic_ref<int, cuda::thread_scope_system> r(*x); r.fetch_add(1); }'
    mod = nvrtc.compile_cubin(src, "atomic", nvrtc.CompileOptions(cuda_headers=True))
    assert mod.cubin.startswith(b"\x7fELF")


def test_import_without_gpu_touches_nothing() -> None:
    code = (
        "import sys; import concordia_ft.cuda, concordia_ft.cuda.driver as d, concordia_ft.cuda.nvrtc, "
        "concordia_ft.cuda.handlers, concordia_ft.cuda.trackers, concordia_ft.cuda.memory; "
        "assert not d._initialised; assert 'torch' not in sys.modules; "
        "print('available', d.cuda_available())"
    )
    env = dict(os.environ, PYTHONPATH=str(SRC), CUDA_VISIBLE_DEVICES="")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "available False" in r.stdout


def test_device_error_translation_marks_sticky_codes() -> None:
    from concordia_ft.cuda import driver
    from concordia_ft.errors import DeviceError

    with pytest.raises(DeviceError) as ei:
        driver.check((driver.bindings().CUresult(700),), "a kernel")
    assert ei.value.sticky and ei.value.code == 700 and ei.value.name == "CUDA_ERROR_ILLEGAL_ADDRESS"
    assert "restart" in str(ei.value)
    with pytest.raises(DeviceError) as ei2:
        driver.check((driver.bindings().CUresult(2), None), "cuMemAlloc")
    assert not ei2.value.sticky and ei2.value.name == "CUDA_ERROR_OUT_OF_MEMORY"
    assert driver.check((driver.bindings().CUresult(0), 42), "ok") == 42
    import pickle

    e = pickle.loads(pickle.dumps(ei.value))
    assert e.code == 700 and e.sticky


def test_device_side_assert_is_sticky_and_explained() -> None:
    import pickle

    from concordia_ft.cuda import driver
    from concordia_ft.errors import DeviceError

    with pytest.raises(DeviceError) as ei:
        driver.check((driver.bindings().CUresult(710),), "cuStreamSynchronize")
    e = ei.value
    assert e.sticky and e.name == "CUDA_ERROR_ASSERT" and "device-side assert" in e.explanation
    assert "restart the process" in str(e) and "device-side assert" in str(e)
    back = pickle.loads(pickle.dumps(e))
    assert (back.code, back.sticky, back.explanation, str(back)) == (710, True, e.explanation, str(e))
    # next to it in the numbering, but the context survives
    for code in (709, 720):
        with pytest.raises(DeviceError) as ei2:
            driver.check((driver.bindings().CUresult(code),), "x")
        assert not ei2.value.sticky and ei2.value.explanation and "go on using CUDA" in str(ei2.value)
    # a code outside our table is explained from the driver's own documentation
    assert "allocate enough memory" in driver.explain(2)


def test_sticky_table_matches_the_installed_driver_documentation() -> None:
    """Every CUresult that cuda-bindings documents as poisoning (restart needed, or the context must be
    destroyed) is sticky in our table, every name in the table is the driver's own, and nothing documented as
    recoverable is called sticky except 214 (uncorrectable ECC: device memory lost)."""
    from cuda.bindings import driver as drv

    from concordia_ft.cuda import results

    documented = set()
    for member in drv.CUresult:
        doc = " ".join((member.__doc__ or "").split())
        if "must be terminated and relaunched" in doc or "context cannot be used anymore" in doc:
            documented.add(int(member))
    assert {700, 702, 710, 714, 715, 716, 717, 718, 719, 721} <= documented  # the docs did say this
    missing = sorted(documented - set(results.STICKY_CODES))
    assert not missing, f"documented as poisoning but not sticky here: {missing}"
    assert set(results.STICKY_CODES) - documented <= {214}
    for code, info in results.RESULTS.items():
        assert drv.CUresult(code).name == info.name, code
        assert info.explanation and not info.explanation.endswith(".")


def test_reference_hash_sees_every_single_byte_change() -> None:
    rng = np.random.default_rng(7)
    data = rng.integers(0, 256, 3 * 4096 + 100, dtype=np.uint8)
    h0 = handlers.reference_page_hash(data, 4096)
    assert len(h0) == 4 and len(set(h0.tolist())) == 4
    for pos in rng.choice(len(data), 50, replace=False):
        d = data.copy()
        d[pos] ^= np.uint8(1 << int(rng.integers(0, 8)))
        h = handlers.reference_page_hash(d, 4096)
        assert (h != h0).tolist() == [i == pos // 4096 for i in range(4)]
    # zero padding of the tail page: explicit zeros past the end hash like the padded region
    assert handlers.reference_page_hash(np.concatenate([data, np.zeros(4096 - 100, np.uint8)]), 4096)[3] == h0[3]


# A child that compiles with an empty cache, then checks that the interpreter's shared immutable objects are
# what they were. CPython caches every one-byte bytes object (bytes([i]), b"%c" % i, b" " * 1 all return it):
# handing one to NVRTC as an output buffer rewrites that byte for the whole process. The checks avoid
# comparing two cached objects with each other (b" " == bytes([32]) holds even when both are corrupted).
_INTEGRITY_CHILD = r'''
import hashlib, sys
from concordia_ft.cuda import crc, handlers, nvrtc
from concordia_ft.core.regions import RegionKind, RegionSpec

def one_byte_objects_intact():
    bad = []
    for i in range(256):
        for obj in (bytes([i]), b"%c" % i, bytes((i,)) * 1, chr(i).encode("latin-1")):
            if len(obj) != 1 or obj[0] != i or list(obj) != [i]:
                bad.append((i, list(obj)))
    return bad

before = one_byte_objects_intact()
assert not before, before
outs = []
clean = 'extern "C" __global__ void concordia_k(int* x) { x[threadIdx.x] += 1; }'  # empty log: size 1
warns = 'extern "C" __global__ void concordia_w(int* x) { int unused = 3; x[0] = 1; }'  # a non-empty log
for src, name in ((clean, "clean"), (warns, "warns")):
    m = nvrtc.compile_cubin(src, name)
    assert not m.cache_hit
    outs.append((m, hashlib.sha256(m.cubin).hexdigest()))
for m in (handlers.compile_handlers(RegionSpec("r", RegionKind.OPAQUE, 12345, page_bytes=512)),
          crc.compile_crc()):
    outs.append((m, hashlib.sha256(m.cubin).hexdigest()))
# every output is stable: the bytes handed back never change, and equal a fresh compile and the cache file
for m, digest in outs:
    assert hashlib.sha256(m.cubin).hexdigest() == digest, m.name
    assert m.cubin.startswith(b"\x7fELF") and m.path is not None and m.path.read_bytes() == m.cubin, m.name
again = nvrtc.compile_cubin(clean, "clean", use_cache=False)
assert again.cubin == outs[0][0].cubin and hashlib.sha256(outs[0][0].cubin).hexdigest() == outs[0][1]
after = one_byte_objects_intact()
assert not after, "one-byte bytes objects rewritten: " + repr(after[:8])
assert bytes([32])[0] == 32 and b" "[0] == 32 and b"\x00"[0] == 0
print("T", 914, sep=" ")
print("A", "B")
sys.stdout.flush()
'''


def test_compile_leaves_the_interpreter_intact(tmp_path: Path) -> None:
    """A real NVRTC compile with an empty cache, in a fresh interpreter: every one-byte bytes object still
    holds its byte, print's separator is still a space, the returned cubins never change."""
    env = dict(os.environ, PYTHONPATH=str(SRC), CONCORDIA_CACHE_DIR=str(tmp_path / "fresh-cache"))
    r = subprocess.run([sys.executable, "-c", _INTEGRITY_CHILD], capture_output=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr.decode(errors="replace")
    assert r.stdout == b"T 914\nA B\n", r.stdout  # through the pipe: str " " is encoded to the cached b" "
    assert list((tmp_path / "fresh-cache" / "cubin").iterdir())  # it did compile (the cache was empty)


@pytest.mark.parametrize(("cached", "requested", "torch_current", "planned"), [
    (None, None, None, -1),  # first call, no torch: the default (device 0)
    (None, None, 2, 2),  # first call: torch's current device
    (None, 1, 2, 1),  # an explicit device wins
    (0, None, None, None),  # no torch: the thread's cached context stands
    (0, None, 0, None),  # torch agrees with the cache
    (0, None, 1, 1),  # torch.cuda.set_device(1) after our first call: follow it (the old code stayed on 0)
    (0, 0, 1, 0),  # asked for 0 but torch moved the thread to 1: make 0 current again (old code: nothing)
    (0, 1, None, 1),  # another device asked for
    (1, 1, 1, None),
])
def test_context_plan_follows_torch_set_device(cached: int | None, requested: int | None,
                                               torch_current: int | None, planned: int | None) -> None:
    from concordia_ft.cuda import driver

    assert driver.plan_context(cached, requested, torch_current) == planned
