"""Wiring the safe-point rewriter into Triton 3.6's compile pipeline.

``install()`` wraps the ``ptx`` stage through ``triton.knobs.runtime.add_stages_inspection_hook`` so every
kernel compiled afterwards in this process gets its safe points before ptxas sees it. Triton 3.6 does not fold
the hook into its cache key (its ``get_cache_key`` has no term for it, and a disk-cache hit returns before the
hook runs), so ``install()`` also points Triton at a cache directory of its own: an
instrumented cubin never lands under an uninstrumented key and the other way round. Inductor compiles in
worker processes unless ``TORCHINDUCTOR_COMPILE_THREADS=1``; the environment this sets reaches them only for
the cache directory, so compile in-process while instrumenting.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import sys
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from . import header_arg
from .safepoints import PROTOCOL_VERSION, SYMBOL_PREFIX, KernelReport, SafepointOptions, rewrite_ptx

_lock = threading.Lock()
_reports: dict[str, KernelReport] = {}
_installed: dict[str, Any] = {}


def launch_refusals(options: Any, name: str) -> dict[str, tuple[str, str]]:
    """Refusals the compile options show and the PTX may not (clusters, PDL, cooperative grids)."""
    out: dict[str, tuple[str, str]] = {}
    if int(getattr(options, "num_ctas", 1) or 1) > 1:
        out[name] = ("cluster", f"num_ctas={options.num_ctas}")
    elif getattr(options, "launch_cooperative_grid", False):
        out[name] = ("cooperative", "launch_cooperative_grid=True")
    elif getattr(options, "launch_pdl", False):
        out[name] = ("pdl", "launch_pdl=True")
    return out


def default_cache_dir(options: SafepointOptions) -> Path:
    """A cache directory per probe protocol and options: Triton's own key knows neither."""
    salt = hashlib.sha256(f"{PROTOCOL_VERSION}:{options!r}".encode()).hexdigest()[:12]
    return Path(tempfile.gettempdir()) / f"concordia-ft-triton-{os.getuid()}" / salt


def install(options: SafepointOptions | None = None, *, cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """Instrument every Triton kernel compiled from now on in this process; returns the cache directory used.

    ``options`` None: ``SafepointOptions(header_arg=True)``, the header's address in each kernel's profile-scratch
    parameter and nothing in the module's constant bank (a kernel whose metadata has no free profile-scratch
    parameter, as under Proton, gets the constant-bank pointer instead). Measured on the H200 (DESIGN.md §6),
    CUDA graphs of a compiled Qwen3 layer: armed +0.2 to +1.8% where the constant-bank pointer costs +2.1 to
    +4.3%. Pass ``SafepointOptions()`` for the constant-bank pointer everywhere.

    Kernels already compiled (Triton's in-memory cache) stay as they were: install before the first launch."""
    from triton import knobs

    opts = options or SafepointOptions(header_arg=True)
    with _lock:
        if _installed:
            return Path(_installed["cache_dir"])
        d = Path(cache_dir) if cache_dir is not None else default_cache_dir(opts)
        d.mkdir(parents=True, exist_ok=True)
        prev_hook = knobs.runtime.add_stages_inspection_hook
        prev_dir = os.environ.get("TRITON_CACHE_DIR")

        def hook(backend: Any, stages: dict[str, Any], topts: Any, language: Any, capability: Any) -> Any:
            if prev_hook is not None:
                prev_hook(backend, stages, topts, language, capability)
            make_ptx = stages.get("ptx")
            if make_ptx is None:
                return None

            def ptx_stage(src: Any, metadata: dict[str, Any]) -> str:
                ptx = make_ptx(src, metadata)
                name = metadata.get("name", "")
                o = opts
                if o.header_arg and metadata.get("profile_scratch_size") != 0:
                    # no profile-scratch parameter here (another Triton), or a profiler (Proton) uses it
                    o = dataclasses.replace(o, header_arg=False)
                res = rewrite_ptx(ptx, o, launch_refusals=launch_refusals(topts, name))
                if o.header_arg and res.changed:  # the launcher now asks our allocator for the parameter
                    metadata["profile_scratch_size"] = header_arg.HARG_SIZE
                    metadata["profile_scratch_align"] = header_arg.route_of(str(metadata.get("hash", "")))
                with _lock:
                    _reports.update({k.name: k for k in res.kernels})
                return res.ptx

            stages["ptx"] = ptx_stage
            return None

        knobs.runtime.add_stages_inspection_hook = hook
        knobs.cache.dir = str(d)
        os.environ["TRITON_CACHE_DIR"] = str(d)  # for compile workers started after this
        static: dict[str, bool] = {}
        if opts.header_arg:
            header_arg.install()
            static = _static_launcher_off()
        _installed.update(cache_dir=str(d), prev_hook=prev_hook, prev_dir=prev_dir, options=opts, static=static)
        return d


_STATIC_KNOBS = ("use_static_triton_launcher", "use_static_cuda_launcher")  # torch 2.13, earlier names


def _static_launcher_off() -> dict[str, bool]:
    """header_arg kernels need Triton's launcher (it fills the header parameter per launch); Inductor's static
    launcher refuses kernels with profile scratch in torch 2.13 and falls back, and turning it off here makes
    that so whatever the torch version. Returns the settings replaced, for ``uninstall()``."""
    if "torch" not in sys.modules:
        return {}
    import torch._inductor.config as icfg  # noqa: TID251 - torch is loaded already (checked above)

    saved = {}
    for k in _STATIC_KNOBS:
        if hasattr(icfg, k):
            saved[k] = bool(getattr(icfg, k))
            setattr(icfg, k, False)
    return saved


@contextmanager
def suspended() -> Iterator[None]:
    """Compile without probes inside (the uninstrumented baseline), then instrument again as before."""
    with _lock:
        state = dict(_installed)
    uninstall()
    try:
        yield
    finally:
        if state:
            install(state["options"], cache_dir=state["cache_dir"])


def uninstall() -> None:
    from triton import knobs

    with _lock:
        if not _installed:
            return
        knobs.runtime.add_stages_inspection_hook = _installed["prev_hook"]
        if _installed["options"].header_arg:
            header_arg.uninstall()
            if _installed.get("static"):
                import torch._inductor.config as icfg  # noqa: TID251 - set by install() with torch loaded

                for k, v in _installed["static"].items():
                    setattr(icfg, k, v)
        prev = _installed["prev_dir"]
        del knobs.cache.dir  # back to the environment's value
        if prev is None:
            os.environ.pop("TRITON_CACHE_DIR", None)
        else:
            os.environ["TRITON_CACHE_DIR"] = prev
        _installed.clear()


def scan_cache(cache_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """The compiled kernels in a Triton cache directory and which carry probes (the ``cft_ctl_`` marker in
    their PTX / cubin): the proof that a baseline ran plain kernels and an instrumented run did not."""
    marker = SYMBOL_PREFIX.encode()
    out: dict[str, Any] = {"ptx": 0, "ptx_with_probes": 0, "cubin": 0, "cubin_with_probes": 0, "kernels": {}}
    for p in sorted(Path(cache_dir).rglob("*")):
        if p.suffix not in (".ptx", ".cubin") or not p.is_file():
            continue
        kind = p.suffix[1:]
        has = marker in p.read_bytes()
        out[kind] += 1
        out[f"{kind}_with_probes"] += int(has)
        out["kernels"].setdefault(p.stem, {})[kind] = has
    return out


def report(kernel_name: str) -> KernelReport | None:
    """What the rewriter did to ``kernel_name`` in this process (None: not compiled since install())."""
    with _lock:
        return _reports.get(kernel_name)


def reports() -> dict[str, KernelReport]:
    with _lock:
        return dict(_reports)
