"""Benchmark results: the environment stamp, the JSON file, and the table printed last.

Every benchmark writes ``benchmarks/results/<name>-<device-tag>.json`` holding the stamp (device, driver,
library versions, date, git commit), the rows measured, and the baseline rows from the same run.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import statistics
import subprocess
from collections.abc import Iterable, Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

_LIBS = ("numpy", "crc32c", "torch", "transformers", "peft", "cuda-bindings", "cuda-core", "nvidia-cuda-nvrtc",
         "triton", "cupy-cuda13x")


def git_commit(cwd: str | os.PathLike[str] | None = None) -> str:
    """$CONCORDIA_GIT_COMMIT when set (a copy of the tree whose .git is missing or stale, as on the device
    machine, where the copied .git can name an older HEAD than the files); else HEAD of the checkout
    (``+dirty`` with uncommitted changes)."""
    explicit = os.environ.get("CONCORDIA_GIT_COMMIT")
    if explicit:
        return explicit
    fallback = "unknown"
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True, text=True, timeout=10)
        if out.returncode != 0:
            return fallback
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=cwd,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return out.stdout.strip() + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return fallback


def library_versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for name in _LIBS:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return out


def device_info() -> dict[str, Any]:
    """CPU model always; GPU name, driver and SM count when torch sees a CUDA device."""
    info: dict[str, Any] = {"cpu": platform.processor() or platform.machine(), "cpu_count": os.cpu_count()}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    info["cpu"] = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        import torch

        if torch.cuda.is_available():
            p = torch.cuda.get_device_properties(0)
            info.update(gpu=p.name, sm_count=p.multi_processor_count, cuda_runtime=torch.version.cuda)
            smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=20)
            if smi.returncode == 0:
                info["driver"] = smi.stdout.strip().splitlines()[0]
    except Exception:  # noqa: BLE001 - a description must never fail a benchmark
        pass
    return info


def stamp() -> dict[str, Any]:
    return {
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "git_commit": git_commit(Path(__file__).resolve().parent),
        "device": device_info(),
        "versions": library_versions(),
        "host": platform.node(),
    }


def median(values: Iterable[float]) -> float:
    return float(statistics.median(list(values)))


def percentile(values: Sequence[float], q: float) -> float:
    s = sorted(values)
    if not s:
        return float("nan")
    k = min(len(s) - 1, max(0, int(round(q / 100 * (len(s) - 1)))))
    return float(s[k])


def write_results(name: str, rows: list[dict[str, Any]], *, baseline: list[dict[str, Any]] | None = None,
                  notes: str = "", out_dir: str | os.PathLike[str] = "benchmarks/results",
                  tag: str | None = None) -> Path:
    """Write ``<out_dir>/<name>-<tag>.json`` (tag: 'h200', 'cpu', ...) atomically; return its path."""
    st = stamp()
    if tag is None:
        gpu = st["device"].get("gpu", "")
        tag = "h200" if "H200" in gpu else ("gpu" if gpu else "cpu")
    path = Path(out_dir) / f"{name}-{tag}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {"benchmark": name, **st, "notes": notes, "rows": rows, "baseline": baseline or []}
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(doc, indent=1, default=str) + "\n")
    os.replace(tmp, path)
    return path


def save_figure(fig: Any, doc: dict[str, Any], path: str | os.PathLike[str], title: str | None = None,
                fontsize: int = 9) -> Path:
    """Stamp a results figure with what made it (benchmark, device, date, commit) and save it as the PNG beside
    its results JSON; return the PNG's path. The caller closes the figure."""
    dev = doc.get("device", {})
    what = title or doc.get("benchmark", Path(path).stem)
    fig.suptitle(f"{what} on {dev.get('gpu', dev.get('cpu', '?'))} ({str(doc.get('date', ''))[:10]}, commit "
                 f"{str(doc.get('git_commit', ''))[:10]})", fontsize=fontsize)
    fig.tight_layout()
    out = Path(path).with_suffix(".png")
    fig.savefig(out, dpi=110)
    return out


def print_table(title: str, rows: list[dict[str, Any]], columns: Sequence[str] | None = None) -> None:
    """Print rows as a table (rich when present, plain text otherwise)."""
    if not rows:
        print(f"{title}: no rows")
        return
    cols = list(columns or rows[0].keys())

    def fmt(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:.4g}"
        return str(v)

    try:
        from rich.console import Console
        from rich.table import Table

        t = Table(title=title)
        for c in cols:
            t.add_column(c, justify="right")
        for r in rows:
            t.add_row(*(fmt(r.get(c, "")) for c in cols))
        Console(width=200).print(t)
    except ImportError:
        print(title)
        print("  ".join(cols))
        for r in rows:
            print("  ".join(fmt(r.get(c, "")) for c in cols))
