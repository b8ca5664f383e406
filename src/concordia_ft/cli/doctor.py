"""`concordia doctor [--json]`: what this machine offers Concordia-FT, and what to install for the rest."""

from __future__ import annotations

import argparse
import json
import os
import platform
from importlib import metadata
from pathlib import Path
from typing import Any

from .output import console


def add_arguments(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("doctor", help="report the environment (python, torch, CUDA, NVRTC, DRAM backend)")
    p.add_argument("--json", action="store_true")


def _version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def collect() -> dict[str, Any]:
    import crc32c

    from ..core import slotlog, streamed
    from ..core.segment import is_tmpfs

    shm = Path("/dev/shm")
    rep: dict[str, Any] = {
        "concordia_ft": _version("concordia-ft"),
        "python": platform.python_version(),
        "numpy": _version("numpy"),
        "crc32c": _version("crc32c"),
        "crc32c_hardware": bool(getattr(crc32c, "hardware_based", False)),
        "dram_backend": shm.is_dir() and is_tmpfs(shm) and os.access(shm, os.W_OK),
        "torch": _version("torch"),
        "transformers": _version("transformers"),
        "peft": _version("peft"),
        "cuda_bindings": _version("cuda-bindings"),
        "nvrtc": _version("nvidia-cuda-nvrtc"),
        "cuda_devices": 0,
        "epoch_writer": slotlog.status(),
        "restore_loop": streamed.loop_status(),
        "hints": [],
    }
    try:
        import torch

        rep["cuda_devices"] = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if rep["cuda_devices"]:
            rep["gpu"] = torch.cuda.get_device_name(0)
            # `concordia serve --mirror`: host memory the GPU reads, exportable to a keeper process
            try:
                from ..cuda.mirror import mirror_supported

                why = mirror_supported(0)
                rep["log_mirror"] = "supported" if not why else f"not supported: {why}"
            except Exception as e:  # noqa: BLE001 - a report line, never a failure of the doctor
                rep["log_mirror"] = f"not supported: {e}"
    except ImportError:
        rep["hints"].append("no torch: `pip install 'concordia-ft[llm]'` for tensors, sessions and the demo")
    if not rep["crc32c_hardware"]:
        rep["hints"].append("crc32c runs in software here: checksums will cap log throughput")
    if not rep["nvrtc"]:
        rep["hints"].append("no NVRTC: `pip install 'concordia-ft[cuda]'` for GPU handlers")
    if not rep["epoch_writer"].startswith("c"):
        rep["hints"].append("graph decode's C token-epoch writer is not in use (its Python writer shares the GIL "
                            "with the decode thread): reinstall where a C compiler and the Python headers are present")
    if not rep["dram_backend"]:
        rep["hints"].append("/dev/shm is not a writable tmpfs: use backend='file'")
    return rep


def run(args: argparse.Namespace) -> int:
    rep = collect()
    if args.json:
        print(json.dumps(rep, indent=1))
        return 0
    c = console()
    for k, v in rep.items():
        if k != "hints":
            c.print(f"{k:16s} {v}")
    for h in rep["hints"]:
        c.print(f"[yellow]hint:[/] {h}")
    return 0
