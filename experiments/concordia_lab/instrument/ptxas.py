"""Assembling PTX with ptxas: find a ptxas (Triton's bundled one, then $CUDA_HOME, then PATH) and run it.

Used to prove that rewritten PTX is valid for sm_90a without a GPU, and to read ptxas's resource report
(registers, shared memory, spills) before and after instrumentation. No torch, no cuda imports.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from importlib.util import find_spec
from pathlib import Path

from ..errors import CompileError


def find_ptxas() -> str | None:
    """Path of a ptxas that can assemble sm_90a, or None."""
    env = os.environ.get("CONCORDIA_PTXAS")
    if env:
        return env
    spec = find_spec("triton")
    if spec is not None and spec.origin:
        p = Path(spec.origin).parent / "backends" / "nvidia" / "bin" / "ptxas"
        if p.exists():
            return str(p)
    for root in (os.environ.get("CUDA_HOME"), "/usr/local/cuda"):
        if root and (Path(root) / "bin" / "ptxas").exists():
            return str(Path(root) / "bin" / "ptxas")
    return shutil.which("ptxas")


@dataclass(frozen=True)
class PtxasResult:
    cubin: bytes
    registers: dict[str, int]  # kernel -> registers per thread
    spill_bytes: dict[str, int]  # kernel -> spill stores + loads bytes
    log: str


_FN_RE = re.compile(r"Compiling entry function '([^']+)'")
_REG_RE = re.compile(r"Used (\d+) registers")
_SPILL_RE = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")


def assemble(ptx: str, arch: str = "sm_90a", *, ptxas: str | None = None, timeout_s: float = 120.0) -> PtxasResult:
    """Assemble ``ptx`` to a cubin; raises CompileError with ptxas's log when it is rejected."""
    exe = ptxas or find_ptxas()
    if exe is None:
        raise CompileError("ptxas", "no ptxas found: install triton (it bundles one) or set CONCORDIA_PTXAS")
    with tempfile.TemporaryDirectory(prefix="cft-ptxas-") as d:
        src = Path(d) / "k.ptx"
        out = Path(d) / "k.cubin"
        src.write_text(ptx)
        proc = subprocess.run([exe, f"-arch={arch}", "-v", str(src), "-o", str(out)], capture_output=True,
                              text=True, timeout=timeout_s)
        log = proc.stdout + proc.stderr
        if proc.returncode != 0:
            raise CompileError(f"ptxas -arch={arch}", log)
        regs: dict[str, int] = {}
        spills: dict[str, int] = {}
        current = ""
        for line in log.splitlines():
            if (m := _FN_RE.search(line)):
                current = m.group(1)
            if (m := _REG_RE.search(line)) and current:
                regs[current] = int(m.group(1))
            if (m := _SPILL_RE.search(line)) and current:
                spills[current] = int(m.group(1)) + int(m.group(2))
        return PtxasResult(out.read_bytes(), regs, spills, log)
