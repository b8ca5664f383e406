"""A tiny random Llama with a byte-level tokenizer and a chat template, saved as a model directory, and a
real `concordia serve` subprocess around it (started, waited for, SIGKILLed)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from support import subprocess_env

SPECIALS = ("<|pad|>", "<|bos|>", "<|eos|>")
EOS = 258
CHAT_TEMPLATE = ("{% for m in messages %}<|bos|>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|bos|>assistant: {% endif %}")


def _byte_chars() -> list[str]:
    """The printable stand-in of each byte used by byte-level BPE vocabularies (bytes 0..255 in order)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    extra = iter(range(256, 512))
    return [chr(b) if b in keep else chr(next(extra)) for b in range(256)]


def byte_tokenizer() -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {c: i for i, c in enumerate(_byte_chars())}
    for i, s in enumerate(SPECIALS):
        vocab[s] = 256 + i
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIALS))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<|pad|>", bos_token="<|bos|>",
                                   eos_token="<|eos|>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def make_tiny_model_dir(path: Path, *, seed: int = 0) -> Path:
    """hidden 64, 2 layers, 4 query / 2 KV heads, vocab 259 (bytes + 3 specials), weights ~N(0, 0.2)."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    if (path / "config.json").is_file():
        return path
    cfg = LlamaConfig(vocab_size=259, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                      bos_token_id=257, eos_token_id=EOS, pad_token_id=256, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.2)
    tmp = path.with_name(path.name + ".tmp")
    model.save_pretrained(tmp)
    byte_tokenizer().save_pretrained(tmp)
    os.replace(tmp, path)
    return path


class ServerProc:
    """`concordia serve` in a subprocess of its own process group."""

    def __init__(self, model_dir: Path | None, log_dir: Path, *args: str, timeout_s: float = 120.0) -> None:
        cmd = [sys.executable, "-m", "concordia_ft.cli.main", "serve", "--log", str(log_dir), "--port", "0",
               *(["--model", str(model_dir)] if model_dir is not None else []), *args]
        env = subprocess_env()
        env.setdefault("OMP_NUM_THREADS", "1")
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                                     start_new_session=True)
        self.stderr_lines: list[str] = []  # read all along (the request log must never fill the pipe)
        self._err_reader = threading.Thread(target=self._read_stderr, daemon=True)
        self._err_reader.start()
        self.ready = self._wait_ready(timeout_s)
        self.stdout_lines: list[str] = []
        threading.Thread(target=self._read_stdout, daemon=True).start()
        self.port = int(self.ready["port"])
        self.base = f"http://127.0.0.1:{self.port}"

    def _read_stderr(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.stderr_lines.append(line)

    def _read_stdout(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.stdout_lines.append(line)

    @property
    def stderr(self) -> str:
        """What the server wrote to stderr so far (all of it once it exited)."""
        if self.proc.poll() is not None:
            self._err_reader.join(timeout=10)
        return "".join(self.stderr_lines)

    def events(self, ev: str) -> list[dict[str, Any]]:
        """The JSON lines of kind ``ev`` on stderr (the request log: ``"request"``)."""
        out = []
        for line in self.stderr.splitlines():
            try:
                d = json.loads(line)
            except ValueError:
                continue
            if isinstance(d, dict) and d.get("ev") == ev:
                out.append(d)
        return out

    def _wait_ready(self, timeout_s: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        assert self.proc.stdout is not None
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                rc = self.proc.wait()
                raise RuntimeError(f"the server exited ({rc}) before it was ready:\n{self.stderr[-4000:]}")
            try:
                ev = json.loads(line)
            except ValueError:
                continue
            if ev.get("ev") == "ready":
                return dict(ev)
        self.kill()
        raise RuntimeError(f"the server was not ready within {timeout_s} s")

    def client(self, **kw: Any) -> Any:
        import openai

        return openai.OpenAI(base_url=self.base + "/v1", api_key="none", max_retries=0, **kw)

    def kill(self) -> int:
        """SIGKILL the server and wait for it to be gone (returns the wait status)."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        return self.proc.wait(timeout=30)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                return self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                return self.kill()
        return self.proc.returncode
