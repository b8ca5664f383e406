"""NVRTC: compile CUDA C++ source to a cubin for one architecture, with an on-disk cache; load modules.

Compilation needs no GPU (only the NVRTC library from the ``nvidia-cuda-nvrtc`` wheel or a CUDA toolkit), so
CPU CI compiles every handler. A cubin (SASS) rather than PTX is produced: it loads on any driver that supports
the CUDA major version (PTX from a newer NVRTC would not JIT on an older driver).

Cache: ``<cache_dir>/cubin/<sha256>.cubin`` where the key hashes the source, the NVRTC version, the arch and
every option (include directories included). ``cache_dir`` is ``$CONCORDIA_CACHE_DIR`` or
``~/.cache/concordia-ft``, never inside the package. Writes go to a temp file then ``os.replace``: readers see
a whole cubin or none, and concurrent writers of the same key are harmless. Within a process, compiles are
single-flight per key: threads asking for the same key while it compiles wait for that one compile and read
its result (``stats["compiles"]`` counts NVRTC runs); different keys compile in parallel.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import CompileError, ConfigError
from . import driver

DEFAULT_ARCH = "sm_90"
_CUBIN_MAGIC = b"\x7fELF"

stats = {"compiles": 0}  # NVRTC runs in this process (cache misses that compiled)
_key_locks: dict[str, threading.Lock] = {}  # one per key while someone compiles it
_key_locks_guard = threading.Lock()


@dataclass(frozen=True)
class CompileOptions:
    """How to compile. ``cuda_headers``: put the CUDA toolkit headers (and CCCL, for <cuda/atomic>) on the
    include path; handlers need none, so the default leaves them out and compiles anywhere NVRTC exists."""

    arch: str = DEFAULT_ARCH
    std: str = "c++17"
    cuda_headers: bool = False
    include_dirs: tuple[str, ...] = ()
    defines: tuple[tuple[str, str], ...] = ()
    extra: tuple[str, ...] = ("-default-device",)
    line_info: bool = False

    def flags(self) -> list[str]:
        arch = self.arch if self.arch.startswith(("sm_", "compute_")) else f"sm_{self.arch}"
        out = [f"-arch={arch}", f"-std={self.std}", *self.extra]
        if self.line_info:
            out.append("-lineinfo")
        out += [f"-D{k}={v}" for k, v in self.defines]
        dirs = list(self.include_dirs) + (find_cuda_include_dirs() if self.cuda_headers else [])
        out += [f"-I{d}" for d in dirs]
        return out


@dataclass
class CompiledModule:
    name: str
    cubin: bytes
    key: str
    cache_hit: bool
    log: str = ""
    path: Path | None = None
    options: list[str] = field(default_factory=list)


def _nvrtc() -> Any:
    try:
        from cuda.bindings import nvrtc
    except ImportError as e:  # pragma: no cover - environment
        raise ConfigError(
            f"NVRTC is not importable ({e}); install the 'cuda' extra: pip install 'concordia-ft[cuda]' "
            "(cuda-bindings and nvidia-cuda-nvrtc)"
        ) from None
    return nvrtc


def _nv_check(result: Any, what: str, log: str = "") -> Any:
    nvrtc = _nvrtc()
    err = result[0] if isinstance(result, tuple) else result
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        msg = nvrtc.nvrtcGetErrorString(err)[1]
        raise CompileError(what, f"{msg.decode() if isinstance(msg, bytes) else msg}\n{log}".strip())
    if isinstance(result, tuple) and len(result) > 1:
        return result[1] if len(result) == 2 else result[1:]
    return None


def nvrtc_version() -> tuple[int, int]:
    try:
        major, minor = _nv_check(_nvrtc().nvrtcVersion(), "nvrtcVersion")
    except OSError as e:  # the shared library is missing
        raise ConfigError(f"libnvrtc could not be loaded ({e}); pip install nvidia-cuda-nvrtc") from None
    return int(major), int(minor)


def cache_dir() -> Path:
    d = os.environ.get("CONCORDIA_CACHE_DIR")
    return Path(d).expanduser() if d else Path.home() / ".cache" / "concordia-ft"


def _candidate_roots() -> list[Path]:
    roots = []
    for var in ("CUDA_HOME", "CUDA_PATH"):
        v = os.environ.get(var)
        if v:
            roots.append(Path(v))
    roots += [Path("/usr/local/cuda"), *sorted(Path("/usr/local").glob("cuda-*"), reverse=True)]
    return roots


def find_cuda_include_dirs() -> list[str]:
    """The CUDA headers (cuda_runtime.h) and CCCL (cuda/std/version, for <cuda/atomic>) directories.

    Searched: cuda.pathfinder (NVIDIA wheels, conda, CUDA_HOME/CUDA_PATH, system toolkits), then
    $CUDA_HOME, $CUDA_PATH, /usr/local/cuda*. Raises ConfigError naming exactly what is missing."""
    found: dict[str, str] = {}
    try:
        from cuda import pathfinder

        for lib in ("cudart", "cccl"):
            d = pathfinder.find_nvidia_header_directory(lib)
            if d:
                found[lib] = str(d)
    except Exception:  # noqa: BLE001 - pathfinder is optional; fall back to the plain search below
        pass
    for root in _candidate_roots():
        inc = root / "include"
        if "cudart" not in found and (inc / "cuda_runtime.h").is_file():
            found["cudart"] = str(inc)
        if "cccl" not in found:
            for cand in (inc / "cccl", inc):
                if (cand / "cuda" / "std" / "version").is_file():
                    found["cccl"] = str(cand)
                    break
    missing = [lib for lib in ("cudart", "cccl") if lib not in found]
    if missing:
        what = {"cudart": "CUDA runtime headers (cuda_runtime.h)", "cccl": "CCCL headers (cuda/std/version)"}
        raise ConfigError(
            "missing " + " and ".join(what[m] for m in missing) + "; searched NVIDIA wheels, CUDA_HOME, "
            "CUDA_PATH and /usr/local/cuda*; install a CUDA toolkit and set CUDA_HOME, or "
            "pip install nvidia-cuda-runtime nvidia-cuda-cccl"
        )
    return [found["cudart"], found["cccl"]] if found["cccl"] != found["cudart"] else [found["cudart"]]


def cache_key(source: str, options: CompileOptions) -> str:
    major, minor = nvrtc_version()
    h = hashlib.sha256()
    for part in (source, f"nvrtc {major}.{minor}", options.arch, "\0".join(options.flags())):
        h.update(part.encode())
        h.update(b"\0\1")
    return h.hexdigest()


def _write_atomic(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def _read_output(get_size: Any, get: Any, prog: Any, what: str) -> bytes:
    """One of NVRTC's outputs (log, cubin) as a new ``bytes``. NVRTC writes into the buffer it is handed, so
    that buffer is a fresh ``bytearray``: never an immutable ``bytes``, which could be an object the
    interpreter shares (``b" " * 1`` IS the cached one-byte ``b" "``: writing NUL into it once turned every
    ``bytes([32])`` and ``print``'s separator into ``b"\\0"`` for the rest of the process)."""
    size = int(_nv_check(get_size(prog), f"{what} size"))
    buf = bytearray(size)
    if size:
        _nv_check(get(prog, buf), what)
    return bytes(buf)


def _compile(source: str, name: str, flags: list[str]) -> tuple[bytes, str]:
    nvrtc = _nvrtc()
    prog = _nv_check(nvrtc.nvrtcCreateProgram(source.encode(), f"{name}.cu".encode(), 0, [], []),
                     f"{name}: nvrtcCreateProgram")
    try:
        opts = [f.encode() for f in flags]
        res = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
        raw_log = _read_output(nvrtc.nvrtcGetProgramLogSize, nvrtc.nvrtcGetProgramLog, prog, f"{name}: log")
        log = raw_log.rstrip(b"\0 ").decode(errors="replace")
        if res[0] != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            raise CompileError(name, f"options: {' '.join(flags)}\n{log}")
        cubin = _read_output(nvrtc.nvrtcGetCUBINSize, nvrtc.nvrtcGetCUBIN, prog, f"{name}: cubin")
        return cubin, log
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


def compile_cubin(source: str, name: str, options: CompileOptions | None = None, *,
                  use_cache: bool = True) -> CompiledModule:
    """Compile ``source`` to a cubin (from the cache when the same key was compiled before). Thread-safe:
    concurrent calls for one key run NVRTC once (the others wait and read the cached cubin)."""
    options = options or CompileOptions()
    flags = options.flags()
    key = cache_key(source, options)
    path = cache_dir() / "cubin" / f"{key}.cubin"
    if not use_cache:
        return _compile_checked(source, name, options, key, flags, None)
    hit = _read_cached(path, name, key, flags)
    if hit is not None:
        return hit
    with _key_lock(key):
        hit = _read_cached(path, name, key, flags)  # compiled by the thread we waited for
        if hit is not None:
            return hit
        return _compile_checked(source, name, options, key, flags, path)


def _key_lock(key: str) -> threading.Lock:
    with _key_locks_guard:
        lock = _key_locks.get(key)
        if lock is None:
            lock = _key_locks[key] = threading.Lock()
        return lock


def _read_cached(path: Path, name: str, key: str, flags: list[str]) -> CompiledModule | None:
    try:
        data = path.read_bytes()
    except OSError:
        return None
    return CompiledModule(name, data, key, True, "", path, flags) if data.startswith(_CUBIN_MAGIC) else None


def _compile_checked(source: str, name: str, options: CompileOptions, key: str, flags: list[str],
                     path: Path | None) -> CompiledModule:
    """Run NVRTC, check the output is a cubin, write it to ``path`` (None: no cache)."""
    cubin, log = _compile(source, name, flags)
    stats["compiles"] += 1
    if not cubin.startswith(_CUBIN_MAGIC):
        raise CompileError(name, f"NVRTC returned {len(cubin)} bytes that are not an ELF cubin (arch {options.arch})")
    if path is not None:
        try:
            _write_atomic(path, cubin)
        except OSError:
            path = None  # a read-only cache must not fail compilation
    return CompiledModule(name, cubin, key, False, log, path, flags)


class Module:
    """A cubin loaded into the current context; ``function(name)`` returns a CUfunction (cached)."""

    def __init__(self, compiled: CompiledModule, device: int | None = None) -> None:
        self.device = driver.ensure_context(device)
        drv = driver.bindings()
        self.name = compiled.name
        self.handle = driver.check(drv.cuModuleLoadData(compiled.cubin), f"cuModuleLoadData({compiled.name})")
        self._functions: dict[str, Any] = {}

    def function(self, name: str) -> Any:
        f = self._functions.get(name)
        if f is None:
            f = driver.check(driver.bindings().cuModuleGetFunction(self.handle, name.encode()),
                             f"cuModuleGetFunction({self.name}.{name})")
            self._functions[name] = f
        return f

    def global_address(self, name: str) -> tuple[int, int]:
        ptr, size = driver.check(driver.bindings().cuModuleGetGlobal(self.handle, name.encode()),
                                 f"cuModuleGetGlobal({self.name}.{name})")
        return int(ptr), int(size)

    def close(self) -> None:
        if self.handle is not None:
            driver.check(driver.bindings().cuModuleUnload(self.handle), f"cuModuleUnload({self.name})")
            self.handle = None


def load_module(source: str, name: str, options: CompileOptions | None = None,
                device: int | None = None) -> Module:
    """Compile (or fetch from the cache) and load into ``device``'s primary context. The arch defaults to
    the device's own."""
    d = driver.ensure_context(device)
    if options is None:
        options = CompileOptions(arch=driver.arch_of(d))
    return Module(compile_cubin(source, name, options), d)
