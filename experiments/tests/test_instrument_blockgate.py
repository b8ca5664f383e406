"""CPU CI: the block gate (a Compute Sanitizer tool) builds with a C compiler and the nvidia-cuda-sanitizer-api
wheel, its patch module with nvcc, both entry paths start it, and the control block Python writes has the
layout the device callback reads. What the patches do on a GPU: experiments/bench_blockgate.py and
instrument/DESIGN.md section 8."""

from __future__ import annotations

import ctypes
import json
import re
import shutil
import struct
import subprocess
import sys
import textwrap

import pytest

from concordia_ft.errors import CompileError
from concordia_lab.instrument import blockgate as bg
from concordia_lab.instrument import interposer as ip

try:
    TOOL = bg.build_tool()
except CompileError as e:  # pragma: no cover - only where the sanitizer wheel is missing
    pytest.skip(f"the block gate does not build here: {e}", allow_module_level=True)


def test_tool_exports_both_entry_points_and_its_controls() -> None:
    assert bg.build_tool() == TOOL  # cached
    syms = ctypes.CDLL(str(TOOL), mode=ctypes.RTLD_LOCAL)
    for s in ("InitializeInjection", "cfb_arm", "cfb_stats"):
        assert hasattr(syms, s)


def _stats_in_child(env: dict[str, str]) -> dict[str, object]:
    code = textwrap.dedent("""
        import json, sys
        from concordia_lab.instrument import blockgate as bg
        print(json.dumps(bg.stats(bg.load())))
    """)
    env = {**env, "PYTHONPATH": ":".join(p for p in sys.path if p)}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stderr
    return dict(json.loads(r.stdout.strip().splitlines()[-1]))


@pytest.mark.skipif(bg.nvcc() is None, reason="no nvcc here: the patch module is device code")
def test_preloaded_tool_subscribes_at_load_and_reads_its_settings() -> None:
    st = _stats_in_child(bg.child_env())
    assert st["started"] is True and st["via"] == "constructor" and st["patch"] is True
    assert st["modules_loaded"] == 0 and st["launches"] == 0 and st["first_error"] == ""
    off = _stats_in_child(bg.child_env(patch=False))
    assert off["started"] is True and off["patch"] is False


@pytest.mark.skipif(bg.nvcc() is None, reason="no nvcc here: the patch module is device code")
def test_injection_path_leaves_the_subscription_to_the_driver() -> None:
    env = bg.child_env(via="injection")
    assert env["CUDA_INJECTION64_PATH"] == str(TOOL) and "LD_PRELOAD" not in {k for k in env if env[k] == str(TOOL)}
    st = _stats_in_child(env)  # no cuInit here: nothing called InitializeInjection
    assert st["started"] is False and st["via"] == "none"
    with pytest.raises(ValueError):
        bg.child_env(via="dlopen")


@pytest.mark.skipif(bg.nvcc() is None, reason="no nvcc here: the patch module is device code")
def test_patch_module_is_a_fatbin_with_sass_holding_the_callback() -> None:
    fat = bg.build_patches().read_bytes()
    assert struct.unpack_from("<I", fat)[0] == 0xBA55ED50
    lib = ip.load(ip.build())
    ptx, sass = ctypes.c_int(), ctypes.c_int()
    assert lib.cft_classify_image(fat, ctypes.byref(ptx), ctypes.byref(sass)) == 3 and sass.value == 1
    assert b"cft_gate_enter" in fat


def test_control_block_layout_matches_the_device_struct(tmp_path) -> None:  # type: ignore[no-untyped-def]
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    src = bg.PATCH_SOURCE.read_text()
    m = re.search(r"struct cft_gate_ctl \{(.*?)\};", src, re.S)
    assert m is not None
    fields = re.findall(r"^\s*\w+\s+(\w+);", m.group(1), re.M)
    prog = tmp_path / "layout.c"
    prog.write_text("#include <stdint.h>\n#include <stddef.h>\n#include <stdio.h>\nstruct cft_gate_ctl {"
                    + m.group(1) + "};\nint main(void){\n"
                    + "".join(f'printf("%zu ", offsetof(struct cft_gate_ctl, {f}));\n' for f in fields)
                    + 'printf("%zu\\n", sizeof(struct cft_gate_ctl));\nreturn 0;}\n')
    exe = tmp_path / "layout"
    subprocess.run([cc, "-o", str(exe), str(prog)], check=True, timeout=60)
    *offs, size = map(int, subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout.split())
    # GateControl writes u32 words: epoch, flags, pause_ptr (2), state_ptr (2), nstate, and reads three counters
    assert dict(zip(fields, offs, strict=True)) == {"epoch": 0, "flags": 4, "pause_ptr": 8, "state_ptr": 16,
                                                    "nstate": 24, "warps_entered": 28, "warps_skipped": 32,
                                                    "blocks_overflow": 36}
    assert size == bg.CTL_WORDS * 4
