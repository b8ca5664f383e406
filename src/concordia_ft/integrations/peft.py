"""PEFT LoRA fine-tuning with one committed epoch per optimizer step.

Every trainable adapter tensor is moved into ONE flat buffer (``lora.params``), and AdamW's ``exp_avg`` /
``exp_avg_sq`` into another (``lora.adam``), both registered ``dense`` (every page is rewritten by each step:
no scan). The two are slices of one arena, the moments starting at the first page boundary after the adapter,
so an asynchronous epoch snapshots both with ONE device copy when the adapter is a whole number of pages (the
runtime's dense batch; a second copy otherwise). AdamW's per-parameter ``step`` counters (CPU scalars unless
fused) and the torch CPU RNG state (dropout) share one small host region, ``lora.state``: the counters as
float32 from byte 0, the RNG state after them. The base weights are frozen: not logged by default (reload them
from their files), or registered ``immutable`` with ``log_weights=True`` (base snapshot once, never diffed).
The metadata of each epoch holds the step number and the loss, so a killed run resumes with the same
next-step loss as an uninterrupted one as long as the data for step ``k`` is a function of ``k``
(``batch_fn(step)``).

An adapter on a GPU also logs that device's CUDA RNG state (``lora.cuda_rng``, 16 bytes: dropout on the GPU
draws from it), so a resumed run draws the same dropout masks as the uninterrupted one.

Layouts: the metadata's ``layout`` says which regions hold the state. 3 (this version): ``lora.params``,
``lora.adam``, ``lora.state``, and ``lora.cuda_rng`` when the metadata's ``cuda_rng`` is true. 2: the same
without ``lora.cuda_rng`` (a GPU run with dropout then resumes with fresh CUDA dropout draws). 1 (no ``layout``
key): the counters in ``lora.steps`` and the RNG state in ``lora.rng``. ``recover`` reads all three; after
recovering an older log the next epoch logs the regions it lacked (and drops layout 1's two), so the log
continues in layout 3.

Asynchronous epochs (``async_checkpoint=True``, the default): each ``train_step`` ends with
``Runtime.checkpoint_async``, which only snapshots the adapter and moments on the GPU (one D2D copy, in stream
order) and the small host region (one copy) and returns; the log write runs on a background thread while the
next step computes. A step's epoch is durable once the next step's checkpoint (or ``wait()``, ``train()``'s end,
``close()``) has waited for it, so a crash loses at most the last step, and ``recover`` continues from the last
committed step with the same losses. The default is async because that exactness holds either way while sync
epochs hold every step up for the whole log write (28 ms of a 144 ms step on the H200 benchmark); the price is
one step of loss window and a device copy of the dense state (``runtime.snapshot_device_bytes``, 53 MB for
Qwen2.5-0.5B r=8).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ..core.regions import DEFAULT_PAGE_BYTES
from ..errors import ConfigError, RecoveryError

if TYPE_CHECKING:
    from ..runtime import PendingEpoch

META_KEY = "concordia.lora"
LAYOUT = 3  # the regions this version writes (see the module docstring); recover() also reads layouts 1 and 2
STATE_PAGE_BYTES = 512  # lora.state is a few KB: small pages keep its padding small
ALL_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def default_lora_config(r: int = 8, alpha: int = 16, dropout: float = 0.0,
                        targets: Iterable[str] = ALL_PROJECTIONS) -> Any:
    from peft import LoraConfig

    return LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout, target_modules=list(targets),
                      task_type="CAUSAL_LM", bias="none")


def _flatten_into(tensors: list[torch.Tensor], flat: torch.Tensor) -> None:
    """Copy every tensor into consecutive slices of ``flat`` and re-point each tensor's storage at its slice."""
    off = 0
    for t in tensors:
        n = t.numel()
        flat[off: off + n].copy_(t.detach().reshape(-1))
        t.data = flat[off: off + n].view_as(t)
        off += n


def plan_arena(n_params: int, element_bytes: int, page_bytes: int) -> tuple[int, int]:
    """(moments offset, arena length) in elements: the adapter at 0, the two moments from the first page
    boundary after it, so the adapter is whole pages of the arena and both regions start page-aligned."""
    page_elems = max(1, page_bytes // element_bytes)
    start = -(-n_params // page_elems) * page_elems
    return start, start + 2 * n_params


@dataclass
class StepResult:
    """One optimizer step. ``checkpoint_s`` is how long the step was held up by checkpointing (the call on the
    training thread). With asynchronous epochs ``epoch`` is the number the step's epoch gets when it commits;
    ``durable``, ``pages``, ``payload_bytes`` and ``commit_latency_s`` are filled in once it has (the next
    step's checkpoint, ``wait()``), and stay unset if it failed."""

    step: int
    loss: float
    epoch: int
    step_s: float
    checkpoint_s: float
    pages: int
    payload_bytes: int
    durable: bool = True
    commit_latency_s: float | None = None
    backpressure_s: float = 0.0


@dataclass
class TrainStats:
    results: list[StepResult] = field(default_factory=list)


class LoraTrainer:
    """LoRA SFT with AdamW: ``trainer.train_step(batch)`` = forward + backward + step + ONE committed epoch."""

    def __init__(self, base_model: Any, log_dir: str | Path, *, lora_config: Any = None, lr: float = 1e-4,
                 weight_decay: float = 0.0, fsync: str = "never", backend: str = "file", log_weights: bool = False,
                 async_checkpoint: bool = True, runtime_options: dict[str, Any] | None = None,
                 _runtime: Any = None) -> None:
        from peft import get_peft_model

        from .. import runtime as _rt

        if _runtime is None and Path(log_dir).is_dir() and any(Path(log_dir).iterdir()):
            raise ConfigError(f"{log_dir} already holds a log; continue it with LoraTrainer.recover(...) or pass "
                              "an empty directory")
        self.lora_config = lora_config or default_lora_config()
        self.model = get_peft_model(base_model, self.lora_config)
        self.model.train()
        named = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
        if not named:
            raise ConfigError("the LoRA config matched no module: no trainable parameter (check target_modules)")
        dtypes = {p.dtype for _, p in named}
        if len(dtypes) != 1:
            raise ConfigError(f"adapter tensors have mixed dtypes {sorted(map(str, dtypes))}; use one dtype")
        self.param_names = [n for n, _ in named]
        params = [p for _, p in named]
        dev, dt = params[0].device, params[0].dtype
        n = sum(p.numel() for p in params)
        page_bytes = (_runtime.page_bytes if _runtime is not None
                      else int((runtime_options or {}).get("page_bytes", DEFAULT_PAGE_BYTES)))
        adam_at, arena_len = plan_arena(n, params[0].element_size(), page_bytes)
        self.arena = torch.zeros(arena_len, dtype=dt, device=dev)  # adapter | zero pad | exp_avg, exp_avg_sq
        self.params_flat = self.arena[:n]
        _flatten_into(params, self.params_flat)
        self.adam_flat = self.arena[adam_at:]
        # lora.state: AdamW's `step` counters (CPU float32 scalars) from byte 0, then the CPU RNG state
        rng_bytes = int(torch.get_rng_state().numel())
        self.state_flat = torch.zeros(4 * len(params) + rng_bytes, dtype=torch.uint8)
        self.steps_flat = self.state_flat[: 4 * len(params)].view(torch.float32)
        self.rng_state = self.state_flat[4 * len(params):]  # torch.get_rng_state() is copied here
        self.rng = self.rng_state.numpy()
        # lora.cuda_rng: the adapter's GPU's RNG state (dropout on the GPU draws from it); None on a CPU
        self.device = dev
        self.cuda_rng: torch.Tensor | None = None
        if dev.type == "cuda":
            self.cuda_rng = torch.zeros(int(torch.cuda.get_rng_state(dev).numel()), dtype=torch.uint8)
        self.optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, foreach=True)
        off = 0
        for i, p in enumerate(params):
            k = p.numel()
            self.optimizer.state[p] = {
                "step": self.steps_flat[i],
                "exp_avg": self.adam_flat[off: off + k].view_as(p),
                "exp_avg_sq": self.adam_flat[n + off: n + off + k].view_as(p),
            }
            off += k
        self.step = 0
        self.last_loss: float | None = None
        self.stats = TrainStats()
        self.async_checkpoint = async_checkpoint
        self.committed_step: int | None = None  # the step of the last epoch known to be committed
        self._pending: tuple[PendingEpoch, StepResult] | None = None  # the async epoch in flight
        self.runtime = _runtime if _runtime is not None else _rt.Runtime(
            str(log_dir), fsync=fsync, backend=backend,
            **{"on_compaction_error": "warn", **(runtime_options or {})})  # nor a training run
        self.log_dir = Path(log_dir)
        self.log_weights = log_weights
        rt = self.runtime
        rt.register("lora.params", self.params_flat, kind="dense")
        rt.register("lora.adam", self.adam_flat, kind="dense")
        rt.register("lora.state", self.state_flat, kind="dense", page_bytes=STATE_PAGE_BYTES)
        if self.cuda_rng is not None:
            rt.register("lora.cuda_rng", self.cuda_rng, kind="dense", page_bytes=STATE_PAGE_BYTES)
        self._meta_fixed = {"layout": LAYOUT, "names_n": len(self.param_names), "n_params": n,
                            "dtype": str(dt), "log_weights": log_weights, "cuda_rng": self.cuda_rng is not None}
        if log_weights:
            for name, p in self.model.named_parameters():
                if not p.requires_grad:
                    rt.register(f"weights:{name}", p.data, kind="immutable")

    @property
    def n_adapter_params(self) -> int:
        return int(self.params_flat.numel())

    def _meta(self) -> dict[str, Any]:
        return {META_KEY: {**self._meta_fixed, "step": self.step, "loss": self.last_loss, "time": time.time()}}

    def _capture_rng(self) -> None:
        """Copy the RNG states dropout draws from into the logged regions (before each epoch)."""
        self.rng_state.copy_(torch.get_rng_state())
        if self.cuda_rng is not None:
            self.cuda_rng.copy_(torch.cuda.get_rng_state(self.device))

    def _state_targets(self, layout: int, log_cuda_rng: bool = False) -> dict[str, Any]:
        """The registered buffers (or views of them) that the regions of a log of ``layout`` restore into."""
        dense = {"lora.params": self.params_flat, "lora.adam": self.adam_flat}
        if layout == 1:
            return {**dense, "lora.steps": self.steps_flat, "lora.rng": self.rng}
        if layout in (2, LAYOUT):
            out = {**dense, "lora.state": self.state_flat}
            if log_cuda_rng and self.cuda_rng is not None:
                out["lora.cuda_rng"] = self.cuda_rng
            return out
        raise RecoveryError(f"the log holds LoRA state in layout {layout}; this version of concordia_ft reads "
                            f"layouts 1 to {LAYOUT}: recover it with the version that wrote it, or a newer one")

    def checkpoint(self) -> int:
        """Commit the current state as one epoch now (after the in-flight async epoch); return its number."""
        self._capture_rng()
        try:
            epoch = int(self.runtime.checkpoint(meta=self._meta()))
        finally:
            self._settle()
        self.committed_step = self.step
        return epoch

    def wait(self) -> int | None:
        """Block until the last step's epoch is committed; return the last committed step. Raises
        ``CheckpointError`` if an asynchronous epoch failed (earlier committed steps stay recoverable)."""
        try:
            self.runtime.wait()
        finally:
            self._settle()
        return self.committed_step

    def _settle(self) -> None:
        """Fill in the StepResult of a finished async epoch (committed: durable, sizes, commit latency)."""
        if self._pending is None or not self._pending[0].done():
            return
        handle, res = self._pending
        self._pending = None
        st = handle.stats
        if st is not None and handle.committed:
            res.epoch, res.durable, res.pages, res.payload_bytes = st.epoch, True, st.pages, st.payload_bytes
            res.commit_latency_s = st.commit_latency_seconds
            self.committed_step = max(self.committed_step or 0, res.step)

    def loss_of(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        out = self.model(**batch)
        return out.loss

    def train_step(self, batch: dict[str, torch.Tensor], *, checkpoint: bool = True) -> StepResult:
        """One optimizer step on ``batch`` (input_ids, labels, ...) followed by one epoch: committed before this
        returns (``async_checkpoint=False``), or started and committed in the background (the default; see the
        module docstring). ``checkpoint=False`` logs nothing (a later epoch holds this step's changes)."""
        t0 = time.perf_counter()
        loss = self.loss_of(batch)
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        self.last_loss = float(loss.detach())
        t1 = time.perf_counter()
        if not checkpoint:
            res = StepResult(self.step, self.last_loss, -1, t1 - t0, 0.0, 0, 0, durable=False)
        elif self.async_checkpoint:
            self._capture_rng()
            try:  # waits for the previous epoch; the metadata dict is new and never changed: handed over
                handle = self.runtime.checkpoint_async(meta=self._meta(), copy_meta=False)
            finally:
                self._settle()
            t2 = time.perf_counter()
            res = StepResult(self.step, self.last_loss, handle.epoch, t1 - t0, t2 - t1, 0, 0, durable=False,
                             backpressure_s=handle.backpressure_seconds)
            self._pending = (handle, res)
        else:
            epoch = self.checkpoint()
            t2 = time.perf_counter()
            st = self.runtime.last_stats
            res = StepResult(self.step, self.last_loss, epoch, t1 - t0, t2 - t1,
                             int(getattr(st, "pages", 0)), int(getattr(st, "payload_bytes", 0)),
                             commit_latency_s=getattr(st, "commit_latency_seconds", None),
                             backpressure_s=float(getattr(st, "backpressure_seconds", 0.0)))
        self.stats.results.append(res)
        return res

    def train(self, batch_fn: Callable[[int], dict[str, torch.Tensor]], until_step: int,
              on_step: Callable[[StepResult], Any] | None = None) -> list[StepResult]:
        """Run steps ``self.step .. until_step-1``; the batch of step ``k`` is ``batch_fn(k)``. Returns once the
        last step's epoch is committed (every returned step is durable)."""
        out = []
        while self.step < until_step:
            res = self.train_step(batch_fn(self.step))
            out.append(res)
            if on_step is not None:
                on_step(res)
        self.wait()
        return out

    @classmethod
    def recover(cls, log_dir: str | Path, base_model: Any, *, lora_config: Any = None, lr: float = 1e-4,
                weight_decay: float = 0.0, fsync: str = "never", backend: str = "file",
                async_checkpoint: bool = True, runtime_options: dict[str, Any] | None = None) -> LoraTrainer:
        """Rebuild adapter + optimizer state from the last committed step (pass the same base model + config)."""
        from ..runtime import open_to_recover

        rt, m = open_to_recover(log_dir, META_KEY, "concordia_ft LoRA training", fsync=fsync, backend=backend,
                                runtime_options=runtime_options)
        try:
            t = cls(base_model, log_dir, lora_config=lora_config, lr=lr, weight_decay=weight_decay,
                    log_weights=bool(m.get("log_weights")), async_checkpoint=async_checkpoint, _runtime=rt)
            if t.n_adapter_params != int(m["n_params"]):
                raise RecoveryError(f"this LoRA config makes {t.n_adapter_params} adapter parameters; the log holds "
                                    f"{m['n_params']}: recover with the same base model and LoRA config")
            layout = int(m.get("layout", 1))
            log_cuda_rng = bool(m.get("cuda_rng", False))
            t.runtime.recover_into(t._state_targets(layout, log_cuda_rng))
            if layout == 1:  # the next epoch logs lora.state (registered, not restored: logged in full)
                t.runtime.forget("lora.steps")
                t.runtime.forget("lora.rng")
            torch.set_rng_state(torch.from_numpy(t.rng.copy()))
            if t.cuda_rng is not None and log_cuda_rng:
                torch.cuda.set_rng_state(t.cuda_rng.clone(), t.device)
            elif log_cuda_rng:  # a GPU run recovered onto a CPU: its CUDA RNG state has nothing to seed
                t.runtime.forget("lora.cuda_rng")
            # (a GPU trainer recovering a log without it: lora.cuda_rng is registered, not restored, so the next
            # epoch logs it in full and later recoveries have it)
            t.step, t.last_loss = int(m["step"]), m["loss"]
            t.committed_step = t.step
        except BaseException:
            rt.close()
            raise
        return t

    def close(self) -> None:
        """Finish the in-flight epoch and close the log (raises a background failure nobody saw yet)."""
        try:
            self.runtime.close()
        finally:
            self._settle()

    def __enter__(self) -> LoraTrainer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def synthetic_batch(step: int, *, vocab: int, batch: int = 2, seq: int = 16, seed: int = 0,
                    device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """A deterministic SFT batch for step ``step`` (the data loader state is the step number)."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    ids = torch.randint(3, vocab, (batch, seq), generator=g)
    return {"input_ids": ids.to(device), "labels": ids.clone().to(device)}


__all__ = ["LoraTrainer", "StepResult", "default_lora_config", "synthetic_batch"]
