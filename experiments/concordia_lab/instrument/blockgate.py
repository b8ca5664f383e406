"""Block-entry safe points for SASS-only kernels through the Compute Sanitizer patching API (an evaluation).

``_blockgate.c`` is a Sanitizer tool: loaded into an unmodified process (``child_env()``: LD_PRELOAD, or the
driver's ``CUDA_INJECTION64_PATH``), it patches ``SANITIZER_INSTRUCTION_BLOCK_ENTER`` of every module the driver
loads (PyTorch's own kernels, cuBLAS) to call ``cft_gate_enter`` from ``_blockgate_patch.cu``. A launch armed
with a control block (``cfb_arm``) skips the blocks that ran already in its sequence or that start while the
pause word is set: every thread of such a block returns ``SANITIZER_PATCH_ERROR``, which exits its warp.
DESIGN.md beside this file (section "SASS-only kernels") has what this was measured to do on the H200.

Building needs a C compiler, cuda.h and the nvidia-cuda-sanitizer-api wheel's headers and
``libsanitizer-public.so`` (the ``instrument`` extra); the patch fatbin needs nvcc. Nothing here imports torch
except ``GateControl``, which allocates the control block with it.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import json
import os
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from ..errors import CompileError, InstrumentError
from .interposer import compile_to

HERE = Path(__file__).parent
TOOL_SOURCE = HERE / "_blockgate.c"
PATCH_SOURCE = HERE / "_blockgate_patch.cu"
TOOL_NAME = "libconcordia_blockgate.so"
PATCH_NAME = "blockgate_patches.fatbin"
_CFLAGS = ["-O2", "-Wall", "-Wextra", "-Werror", "-shared", "-fPIC", "-pthread"]
# the control block of _blockgate_patch.cu as u32 words: epoch, flags, pause_ptr (2), state_ptr (2), nstate,
# warps_entered, warps_skipped, blocks_overflow
CTL_WORDS = 10
COUNT_WARPS = 1


def _site_dirs() -> list[Path]:
    return [Path(p) for p in sys.path if p and Path(p).is_dir()]


def sanitizer_dirs() -> tuple[Path, Path]:
    """(include dir with sanitizer.h, lib dir with libsanitizer-public.so): the pip wheel's first, then a
    toolkit's compute-sanitizer (CONCORDIA_SANITIZER_HOME, CUDA_HOME, /usr/local/cuda)."""
    cands: list[tuple[Path, Path]] = []
    env = os.environ.get("CONCORDIA_SANITIZER_HOME")
    if env:
        cands.append((Path(env) / "include", Path(env)))
    for sp in _site_dirs():
        cands.append((sp / "nvidia/cu13/include", sp / "nvidia/cu13/lib"))
        cands.append((sp / "nvidia/cuda_sanitizer_api/include", sp / "nvidia/cuda_sanitizer_api/lib"))
    for root in (os.environ.get("CUDA_HOME"), "/usr/local/cuda"):
        if root:
            cands.append((Path(root) / "compute-sanitizer/include", Path(root) / "compute-sanitizer"))
    for inc, lib in cands:
        if (inc / "sanitizer.h").exists() and (lib / "libsanitizer-public.so").exists():
            return inc, lib
    raise CompileError(TOOL_NAME, "sanitizer.h / libsanitizer-public.so not found: install the 'instrument' extra "
                                  "(nvidia-cuda-sanitizer-api wheel) or set CONCORDIA_SANITIZER_HOME to a "
                                  "compute-sanitizer directory")


def cuda_include_dir() -> Path:
    for sp in _site_dirs():
        for sub in ("nvidia/cu13/include", "nvidia/cuda_runtime/include"):
            if (sp / sub / "cuda.h").exists():
                return sp / sub
    for root in (os.environ.get("CUDA_HOME"), "/usr/local/cuda"):
        if root and (Path(root) / "include" / "cuda.h").exists():
            return Path(root) / "include"
    raise CompileError(TOOL_NAME, "cuda.h not found: install the 'cuda' extra (nvidia-cuda-runtime) or set CUDA_HOME")


def nvcc() -> str | None:
    env = os.environ.get("NVCC")
    if env:
        return env
    found = shutil.which("nvcc")
    if found:
        return found
    for root in (os.environ.get("CUDA_HOME"), "/usr/local/cuda"):
        if root and (Path(root) / "bin" / "nvcc").exists():
            return str(Path(root) / "bin" / "nvcc")
    return None


def cache_dir() -> Path:
    d = os.environ.get("CONCORDIA_CACHE_DIR")
    return (Path(d) if d else Path.home() / ".cache" / "concordia-ft") / "blockgate"


def build_tool(*, force: bool = False) -> Path:
    """Compile the host side (the Sanitizer tool library); returns its path."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise CompileError(TOOL_NAME, "no C compiler (cc/gcc) on PATH; set CC")
    inc, lib = sanitizer_dirs()
    flags = [*_CFLAGS, f"-I{inc}", f"-I{cuda_include_dir()}"]
    link = [f"-L{lib}", "-lsanitizer-public", f"-Wl,-rpath,{lib}"]
    key = hashlib.sha256(TOOL_SOURCE.read_bytes() + repr((cc, flags, link)).encode()).hexdigest()[:16]
    out = cache_dir() / key / TOOL_NAME
    if force or not out.exists():
        compile_to([cc, *flags, str(TOOL_SOURCE), *link, "-o", "{out}"], out, TOOL_NAME)
    return out


def build_patches(*, arch: str = "sm_90", force: bool = False) -> Path:
    """Compile the device callbacks into a tools-patch fatbin with nvcc; returns its path."""
    nv = nvcc()
    if nv is None:
        raise CompileError(PATCH_NAME, "nvcc not found: the patch module is device code (set NVCC or CUDA_HOME)")
    inc, _ = sanitizer_dirs()
    cmd = [nv, "--fatbin", "--compile-as-tools-patch", f"-arch={arch}", f"-I{inc}", str(PATCH_SOURCE), "-o", "{out}"]
    key = hashlib.sha256(PATCH_SOURCE.read_bytes() + repr(cmd).encode()).hexdigest()[:16]
    out = cache_dir() / key / PATCH_NAME
    if force or not out.exists():
        compile_to(cmd, out, PATCH_NAME)
    return out


def child_env(env: dict[str, str] | None = None, *, via: str = "preload", patch: bool = True) -> dict[str, str]:
    """An environment in which a new process loads the tool: ``via`` "preload" (LD_PRELOAD, subscribes at load)
    or "injection" (CUDA_INJECTION64_PATH, the driver calls InitializeInjection at cuInit)."""
    e = dict(os.environ if env is None else env)
    tool = str(build_tool())
    e["CONCORDIA_BLOCKGATE_PATCHES"] = str(build_patches())
    e["CONCORDIA_BLOCKGATE_PATCH"] = "1" if patch else "0"
    _, lib = sanitizer_dirs()
    e["LD_LIBRARY_PATH"] = f"{lib}:{e['LD_LIBRARY_PATH']}" if e.get("LD_LIBRARY_PATH") else str(lib)
    if via == "preload":
        e["LD_PRELOAD"] = f"{tool}:{e['LD_PRELOAD']}" if e.get("LD_PRELOAD") else tool
    elif via == "injection":
        e["CUDA_INJECTION64_PATH"] = tool
        e["CONCORDIA_BLOCKGATE_NO_CTOR"] = "1"
    else:
        raise ValueError(f"via must be 'preload' or 'injection', not {via!r}")
    return e


def load(path: str | os.PathLike[str] | None = None) -> ctypes.CDLL:
    """The tool as ctypes sees it (the copy the process preloaded: same path, same handle)."""
    if path is None:
        pre = [p for p in os.environ.get("LD_PRELOAD", "").split(":") if p.endswith(TOOL_NAME)]
        path = pre[0] if pre else os.environ.get("CUDA_INJECTION64_PATH") or str(build_tool())
    lib = ctypes.CDLL(str(path))
    lib.cfb_arm.restype = ctypes.c_int
    lib.cfb_arm.argtypes = [ctypes.c_char_p, ctypes.c_uint64]
    lib.cfb_stats.restype = ctypes.c_size_t
    lib.cfb_stats.argtypes = [ctypes.c_char_p, ctypes.c_size_t]
    return lib


def stats(lib: ctypes.CDLL) -> dict[str, Any]:
    need = int(lib.cfb_stats(None, 0))
    buf = ctypes.create_string_buffer(need + 256)
    lib.cfb_stats(buf, len(buf))
    return dict(json.loads(buf.value.decode()))


class GateControl:
    """One control block: a pause word in pinned host memory and a state word per block in device memory.

    ``begin(nblocks)`` starts a sequence (all blocks pending); ``launch(fn)`` arms the tool for kernels whose
    name contains ``kernel`` and runs ``fn`` (which must launch the same kernel with the same grid every time);
    ``pending()`` counts blocks that have not run.
    """

    def __init__(self, lib: ctypes.CDLL, kernel: str, *, count_warps: bool = False, device: str = "cuda") -> None:
        import torch

        self._torch = torch
        self.lib = lib
        self.kernel = kernel
        # the pause word lives in device memory and is set by a stream memory op: read from pinned host memory
        # (one PCIe read per deciding warp) it cost ~1 us per warp, serialised (DESIGN.md section 8)
        self.pause_word = torch.zeros(1, dtype=torch.int32, device=device)
        self.ctl = torch.zeros(CTL_WORDS, dtype=torch.int32, device=device)
        self.state = torch.zeros(1, dtype=torch.int32, device=device)
        self.flags = COUNT_WARPS if count_warps else 0
        self.epoch = 0
        self._side: Any = None

    def begin(self, nblocks: int) -> None:
        torch = self._torch
        self.state = torch.zeros(max(1, nblocks), dtype=torch.int32, device=self.ctl.device)
        self.epoch = 0
        self.clear()

    def _write_ctl(self) -> None:
        torch = self._torch
        pp, sp = self.pause_word.data_ptr(), self.state.data_ptr()
        words = [self.epoch, self.flags, pp & 0xFFFFFFFF, pp >> 32, sp & 0xFFFFFFFF, sp >> 32, self.state.numel(),
                 0, 0, 0]
        host = torch.tensor([w if w < 2**31 else w - 2**32 for w in words], dtype=torch.int32)
        self.ctl.copy_(host)

    @contextlib.contextmanager
    def armed(self) -> Iterator[None]:
        """One launch number of the sequence: every armed launch inside shares it (a block decides once per
        number, so repeating a launch inside re-runs the blocks that ran, which only timing loops want)."""
        self.epoch += 1
        if self.epoch >= 1 << 29:
            raise InstrumentError("block gate: more than 2^29 launches in one sequence; call begin() again")
        self._write_ctl()
        if not self.lib.cfb_arm(self.kernel.encode(), self.ctl.data_ptr()):
            raise InstrumentError("the block gate tool is not running in this process: start it with "
                                  "blockgate.child_env() (LD_PRELOAD or CUDA_INJECTION64_PATH)")
        try:
            yield
        finally:
            self.lib.cfb_arm(b"", 0)

    def launch(self, fn: Callable[[], Any]) -> Any:
        with self.armed():
            return fn()

    def pause(self, *, wait: bool = False) -> float:
        """Set the pause word from a separate stream (a stream memory op: it needs no SM, so it lands while the
        armed launch occupies the GPU); returns the host time of the request. wait: return once it landed."""
        from concordia_ft.cuda.driver import Stream, bindings, check, ensure_context

        ensure_context()
        drv = bindings()
        if self._side is None:
            self._side = Stream.create(non_blocking=True)
        t = time.perf_counter()
        check(drv.cuStreamWriteValue32(self._side.handle, self.pause_word.data_ptr(), 1, 0), "cuStreamWriteValue32")
        if wait:
            self._side.synchronize()
        return t

    def clear(self) -> None:
        """Clear the pause word, in stream order before the next launch (after any pause() has landed)."""
        if self._side is not None:
            self._side.synchronize()
        self.pause_word.zero_()

    def counts(self, nblocks: int) -> dict[str, int]:
        """Warp counters (with count_warps) and how many of the first nblocks blocks have run."""
        c = self.ctl.cpu().tolist()
        st = self.state[:nblocks].cpu()
        done = int(((st >> 1) & 1).sum().item())
        return {"warps_entered": int(c[7]), "warps_skipped": int(c[8]), "blocks_overflow": int(c[9]),
                "blocks_done": done, "blocks_pending": int(st.numel()) - done}
