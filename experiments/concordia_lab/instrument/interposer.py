"""The interposer's Python side: build the native observer, load it into a process, read its inventory.

The library (``_interposer.c`` beside this file) is loaded by the CUDA driver itself at ``cuInit`` through
``CUDA_INJECTION64_PATH`` and records every module load and kernel launch through CUPTI callbacks (DESIGN.md
beside this file says why CUPTI rather than an LD_PRELOAD or ``dlsym`` shim). Three ways in:

- ``activate()`` in a process that has not initialised CUDA yet (before torch's first CUDA call);
- ``child_env()`` for a subprocess (an unmodified program: ``concordia``-free code sees nothing of this);
- ``python -m concordia_lab.instrument.interposer --path`` prints the library path for a shell.

``inventory()`` returns what was seen: modules (which loader, image kind, PTX or SASS only, kernels) and
launch counts by kernel. Building needs only a C compiler and the headers of the nvidia-cuda-runtime and
nvidia-cuda-cupti wheels; nothing here imports torch or cuda.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import CompileError, InstrumentError

SOURCE = Path(__file__).with_name("_interposer.c")
SOURCES = (SOURCE, Path(__file__).with_name("_launchcut.c"))  # one library: the observer and the launch cut
LIB_NAME = "libconcordia_interposer.so"
_CFLAGS = ["-O2", "-Wall", "-Wextra", "-Werror", "-shared", "-fPIC", "-pthread"]


def _site_dirs() -> list[Path]:
    return [Path(p) for p in sys.path if p and Path(p).is_dir()]


def include_dirs() -> list[Path]:
    """Directories holding cuda.h and cupti_driver_cbid.h: the pip wheels' first, then a toolkit."""
    want = ("cuda.h", "cupti_driver_cbid.h")
    cands: list[Path] = []
    for sp in _site_dirs():
        for sub in ("nvidia/cu13/include", "nvidia/cuda_runtime/include", "nvidia/cuda_cupti/include"):
            cands.append(sp / sub)
    for root in (os.environ.get("CUDA_HOME"), "/usr/local/cuda"):
        if root:
            cands += [Path(root) / "include", Path(root) / "extras" / "CUPTI" / "include"]
    found: dict[str, Path] = {}
    for d in cands:
        for h in want:
            if h not in found and (d / h).exists():
                found[h] = d
    missing = [h for h in want if h not in found]
    if missing:
        raise CompileError(LIB_NAME, f"headers {missing} not found: install the 'instrument' and 'cuda' extras "
                                     "(nvidia-cuda-cupti, nvidia-cuda-runtime wheels) or set CUDA_HOME")
    return sorted(set(found.values()), key=str)


def cupti_library() -> Path | None:
    """libcupti.so.13 of the nvidia-cuda-cupti wheel (or a toolkit), for the library to dlopen."""
    env = os.environ.get("CONCORDIA_CUPTI_LIB")
    if env:
        return Path(env)
    for sp in _site_dirs():
        for sub in ("nvidia/cu13/lib/libcupti.so.13", "nvidia/cuda_cupti/lib/libcupti.so.12"):
            if (sp / sub).exists():
                return sp / sub
    for root in (os.environ.get("CUDA_HOME"), "/usr/local/cuda"):
        if root:
            for p in sorted((Path(root) / "extras" / "CUPTI" / "lib64").glob("libcupti.so*")):
                return p
    return None


def cache_dir() -> Path:
    d = os.environ.get("CONCORDIA_CACHE_DIR")
    return (Path(d) if d else Path.home() / ".cache" / "concordia-ft") / "interposer"


def build(*, force: bool = False) -> Path:
    """Compile the library (once per source + flags + compiler); returns its path."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise CompileError(LIB_NAME, "no C compiler (cc/gcc) on PATH; set CC")
    incs = include_dirs()
    flags = _CFLAGS + [f"-I{d}" for d in incs]
    key = hashlib.sha256(b"".join(s.read_bytes() for s in SOURCES) + repr((cc, flags)).encode()).hexdigest()[:16]
    out = cache_dir() / key / LIB_NAME
    if out.exists() and not force:
        return out
    compile_to([cc, *flags, "-o", "{out}", *map(str, SOURCES), "-ldl"], out, LIB_NAME, timeout=120)
    return out


def compile_to(cmd: list[str], out: Path, what: str, *, timeout: float = 300) -> None:
    """Run the compiler ``cmd`` (its ``"{out}"`` argument is a temp file beside ``out``), then rename the result
    over ``out``: a concurrent or interrupted build never leaves a half-written library. CompileError on failure."""
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out.parent, suffix=".tmp")
    os.close(fd)
    try:
        proc = subprocess.run([tmp if c == "{out}" else c for c in cmd], capture_output=True, text=True,
                              timeout=timeout)
        if proc.returncode != 0:
            raise CompileError(what, proc.stdout + proc.stderr)
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def child_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """An environment in which a new process loads the interposer at cuInit."""
    e = dict(os.environ if env is None else env)
    e["CUDA_INJECTION64_PATH"] = str(build())
    lib = cupti_library()
    if lib is not None:
        e["CONCORDIA_CUPTI_LIB"] = str(lib)
    return e


def activate() -> Path:
    """Load the interposer into this process at its coming cuInit. Call before anything initialises CUDA."""
    if "torch" in sys.modules:
        torch = sys.modules["torch"]
        if torch.cuda.is_initialized():
            raise InstrumentError("CUDA is already initialised in this process: the interposer would miss every "
                                  "module loaded so far; call activate() first, or use child_env() for a new process")
    env = child_env()
    os.environ["CUDA_INJECTION64_PATH"] = env["CUDA_INJECTION64_PATH"]
    if "CONCORDIA_CUPTI_LIB" in env:
        os.environ["CONCORDIA_CUPTI_LIB"] = env["CONCORDIA_CUPTI_LIB"]
    return Path(env["CUDA_INJECTION64_PATH"])


def load(path: str | os.PathLike[str] | None = None) -> ctypes.CDLL:
    """The library as ctypes sees it: the copy the driver loaded, when it did (same path, same handle)."""
    p = str(path or os.environ.get("CUDA_INJECTION64_PATH") or build())
    lib = ctypes.CDLL(p)
    lib.cft_snapshot.restype = ctypes.c_size_t
    lib.cft_snapshot.argtypes = [ctypes.c_char_p, ctypes.c_size_t]
    lib.cft_error.restype = ctypes.c_char_p
    lib.cft_start.restype = ctypes.c_int
    lib.cft_classify_image.restype = ctypes.c_int
    lib.cft_classify_image.argtypes = [ctypes.c_char_p, ctypes.POINTER(ctypes.c_int), ctypes.POINTER(ctypes.c_int)]
    lib.cft_elf_kernels.restype = ctypes.c_int
    return lib


def snapshot(lib: ctypes.CDLL | None = None) -> dict[str, Any]:
    lib = lib or load()
    need = int(lib.cft_snapshot(None, 0))
    while True:
        buf = ctypes.create_string_buffer(need + 4096)
        got = int(lib.cft_snapshot(buf, len(buf)))
        if got <= len(buf):
            return dict(json.loads(buf.value.decode()))
        need = got


def demangle(name: str) -> str:
    """A C++ symbol as the profiler shows it (libstdc++'s __cxa_demangle); unchanged if not mangled."""
    if not name.startswith("_Z"):
        return name
    try:
        cxx = ctypes.CDLL("libstdc++.so.6")
    except OSError:
        return name
    fn = cxx.__cxa_demangle
    fn.restype = ctypes.c_void_p
    fn.argtypes = [ctypes.c_char_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.POINTER(ctypes.c_int)]
    status = ctypes.c_int(0)
    ptr = fn(name.encode(), None, None, ctypes.byref(status))
    if status.value != 0 or not ptr:
        return name
    out = ctypes.string_at(ptr).decode(errors="replace")
    ctypes.CDLL(None).free(ctypes.c_void_p(ptr))
    return out


@dataclass(frozen=True)
class ModuleRecord:
    id: int
    bytes: int
    api: str | None  # the loader call it was created in; None: loaded lazily by the driver at first use
    image: str  # what that call was handed: cubin, ptx, fatbin, file, unknown
    ptx: bool  # the image carried PTX (the safe-point rewriter can reach its kernels)
    kernels: tuple[str, ...]


@dataclass(frozen=True)
class KernelRecord:
    name: str
    module: int | None  # CUPTI module id, None if no loaded module lists it
    ptx: bool
    launches: int


@dataclass
class Inventory:
    started: bool
    modules: list[ModuleRecord]
    launches: dict[str, int]
    load_calls: dict[str, int]
    load_images: dict[str, dict[str, int]]  # loader -> {image kind: count, "with_ptx": count}
    graph_launches: int
    launch_total: int
    shared_subscriber: bool = False
    kernels: dict[str, KernelRecord] = field(default_factory=dict)

    @classmethod
    def from_snapshot(cls, snap: dict[str, Any]) -> Inventory:
        mods = [ModuleRecord(int(m["id"]), int(m["bytes"]), m["api"], m["image"], bool(m["ptx"]),
                             tuple(m["kernels"])) for m in snap["modules"]]
        where: dict[str, ModuleRecord] = {}
        for m in mods:
            for k in m.kernels:
                where.setdefault(k, m)
        launches = {str(k): int(v) for k, v in snap["launches"].items()}
        kernels = {}
        for name in sorted(set(where) | set(launches)):
            owner = where.get(name)
            kernels[name] = KernelRecord(name, owner.id if owner else None, bool(owner and owner.ptx),
                                         launches.get(name, 0))
        return cls(bool(snap["started"]), mods, launches, {k: int(v) for k, v in snap["load_calls"].items()},
                   {k: {i: int(n) for i, n in v.items()} for k, v in snap.get("load_images", {}).items()},
                   int(snap["graph_launches"]), int(snap["launch_total"]), bool(snap.get("shared_subscriber")),
                   kernels)

    def summary(self) -> dict[str, Any]:
        launched = [k for k in self.kernels.values() if k.launches]
        return {
            "modules": len(self.modules),
            "modules_loaded_lazily": sum(1 for m in self.modules if m.api is None),
            "modules_by_loader": {str(a): sum(1 for m in self.modules if m.api == a)
                                  for a in sorted({m.api for m in self.modules if m.api is not None})},
            "modules_with_ptx": sum(1 for m in self.modules if m.ptx),
            "loader_images_with_ptx": {k: v.get("with_ptx", 0) for k, v in self.load_images.items() if v.get("with_ptx")},
            "kernels_known": len(self.kernels),
            "kernels_launched": len(launched),
            "kernels_launched_from_ptx_images": sum(1 for k in launched if k.ptx),
            "launch_total": self.launch_total,
            "graph_launches": self.graph_launches,
        }


def inventory(lib: ctypes.CDLL | None = None) -> Inventory:
    """What the interposer loaded into this process has seen so far."""
    snap = snapshot(lib)
    if not snap["started"]:
        err = (lib or load()).cft_error().decode()
        raise InstrumentError(f"the interposer is not running in this process ({err}); call activate() before "
                              "CUDA initialises, or start the program with child_env()")
    return Inventory.from_snapshot(snap)


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m concordia_lab.instrument.interposer")
    ap.add_argument("--path", action="store_true", help="build if needed and print the library path")
    ns = ap.parse_args(argv)
    try:
        p = build()
    except CompileError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if ns.path:
        print(p)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
