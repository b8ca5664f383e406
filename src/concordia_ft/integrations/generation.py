"""Generation settings of a Session: what ``model.generate()`` takes, resolved and logged, with its own rules.

A Session's decode loop is its own (integrations/LLM.md says why), but the rules that pick each token are
transformers': ``resolve_settings`` merges a ``GenerationConfig`` and the keyword arguments people pass to
``generate()`` with the model's ``generation_config`` exactly as ``generate()`` does
(``model._prepare_generation_config`` and ``_prepare_generated_length``), and ``plan_rules`` builds the
``LogitsProcessorList`` and ``StoppingCriteriaList`` with the same methods ``generate()`` calls
(``_get_logits_processor``, ``_get_stopping_criteria``), so the arithmetic and the order are generate()'s.

What is logged is the resolved config (every supported field, JSON), the prompt length and the Session's seed:
enough to rebuild the same rules in another process. Every supported processor and criterion is a pure
function of the token ids and the prompt length (none keeps per-token state), so a recovered session that
rebuilds them from the log continues with the same tokens. Settings that would make the tokens depend on
something not in the log (wall-clock ``max_time``, beams, an assistant model, user callables, watermarks) are
refused with a ``ConfigError`` that names them.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import ConfigError, RecoveryError

# GenerationConfig fields that change which token is picked, applied by transformers' own processors and
# stopping criteria; each is a pure function of (token ids, prompt length): nothing to log per token.
SUPPORTED = (
    "max_length", "max_new_tokens", "min_length", "min_new_tokens", "do_sample", "temperature", "top_k",
    "top_p", "min_p", "typical_p", "epsilon_cutoff", "eta_cutoff", "top_h", "repetition_penalty",
    "encoder_repetition_penalty", "no_repeat_ngram_size", "encoder_no_repeat_ngram_size", "bad_words_ids",
    "sequence_bias", "suppress_tokens", "begin_suppress_tokens", "forced_bos_token_id", "forced_eos_token_id",
    "exponential_decay_length_penalty", "remove_invalid_values", "renormalize_logits", "eos_token_id",
    "pad_token_id", "bos_token_id", "stop_strings",
)
# fields that do not change the tokens of one sequence decoded through the Session's own cache
IGNORED = frozenset({
    "use_cache", "cache_implementation", "cache_config", "decoder_start_token_id", "compile_config",
    "disable_compile", "length_penalty", "early_stopping", "transformers_version", "_from_model_config",
    "_commit_hash", "_original_object_hash",
})
# generate() arguments that are not settings: callables and objects a log cannot hold
REFUSED_ARGS = {
    "logits_processor": "a user LogitsProcessor cannot be logged, so a recovered session could not apply it",
    "stopping_criteria": "a user StoppingCriteria cannot be logged, so a recovered session could not apply it",
    "prefix_allowed_tokens_fn": "a callable cannot be logged, so a recovered session could not apply it",
    "assistant_model": "assisted decoding is not supported by Session",
    "assistant_tokenizer": "assisted decoding is not supported by Session",
    "streamer": "use on_token=... (called with each token once it is durable)",
    "negative_prompt_ids": "classifier-free guidance is not supported by Session",
    "negative_prompt_attention_mask": "classifier-free guidance is not supported by Session",
    "synced_gpus": "a Session decodes one sequence in one process",
    "custom_generate": "a Session runs its own decode loop",
    "tokenizer": "pass the tokenizer to Session(..., tokenizer=...) (Session.recover needs it too)",
}
SESSION_DEFAULTS = {"max_new_tokens": 64, "do_sample": False}  # without a generation_config, as before


@dataclass(frozen=True)
class GenerationSettings:
    """One generate() call's resolved settings: ``config`` holds every supported GenerationConfig field after
    the merge (absolute ``max_length``/``min_length``), ``prompt_len`` the ids it started from, ``seed`` the
    Session's own sampler seed (None: the generator continues from its state)."""

    config: Mapping[str, Any] = field(default_factory=dict)
    prompt_len: int = 0
    max_new_tokens: int = 64
    seed: int | None = None

    @property
    def do_sample(self) -> bool:
        return bool(self.config.get("do_sample"))

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        eos = self.config.get("eos_token_id")
        if eos is None:
            return ()
        return tuple(int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos]))

    def __getattr__(self, name: str) -> Any:  # temperature, top_k, ...: the resolved values
        if name in SUPPORTED:
            return self.config.get(name)
        raise AttributeError(name)

    def to_dict(self) -> dict[str, Any]:
        return {"config": dict(self.config), "prompt_len": self.prompt_len, "max_new_tokens": self.max_new_tokens,
                "seed": self.seed}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], *, prompt_len: int | None = None) -> GenerationSettings:
        """From ``to_dict()``, or from the settings a version-1 session log holds (its own field names)."""
        if "config" in d:
            return cls(dict(d["config"]), int(d["prompt_len"]), int(d["max_new_tokens"]), d.get("seed"))
        if prompt_len is None:
            raise RecoveryError("version-1 generation settings need the prompt length of their generate()")
        return _from_v1(d, prompt_len)

    def generation_config(self) -> Any:
        from transformers import GenerationConfig

        cfg = dict(self.config)
        if cfg.get("sequence_bias") is not None:  # logged as [[ids, bias], ...]; the processor takes both forms
            cfg["sequence_bias"] = {tuple(k): float(v) for k, v in cfg["sequence_bias"]}
        gc = GenerationConfig()
        gc.update(**cfg)
        return gc


def _from_v1(d: Mapping[str, Any], prompt_len: int) -> GenerationSettings:
    """Session metadata version 1 logged do_sample .. eos_token_ids itself (no model defaults merged)."""
    n = int(d.get("max_new_tokens", 64))
    cfg: dict[str, Any] = {k: None for k in SUPPORTED}
    cfg.update(max_length=prompt_len + n, max_new_tokens=n, min_length=0, do_sample=bool(d.get("do_sample")),
               temperature=d.get("temperature", 1.0), top_k=d.get("top_k", 50), top_p=d.get("top_p", 1.0),
               min_p=d.get("min_p"), repetition_penalty=d.get("repetition_penalty", 1.0),
               typical_p=1.0, no_repeat_ngram_size=0, encoder_no_repeat_ngram_size=0,
               remove_invalid_values=False, renormalize_logits=False,
               eos_token_id=list(d.get("eos_token_ids", ())) or None)
    return GenerationSettings(cfg, prompt_len, n, d.get("seed"))


def _reference_defaults() -> dict[str, Any]:
    """Every GenerationConfig field at the value generate() uses when nobody sets it."""
    from transformers import GenerationConfig

    ref = GenerationConfig()
    defaults = getattr(GenerationConfig, "_get_default_generation_params", None)
    if defaults is not None:
        ref.update(**defaults(), defaults_only=True)
    return ref.to_dict()


def _jsonable(name: str, value: Any) -> Any:
    if name == "sequence_bias" and isinstance(value, Mapping):
        value = [[list(k), float(v)] for k, v in value.items()]
    if isinstance(value, tuple):
        value = list(value)
    try:
        return json.loads(json.dumps(value))
    except (TypeError, ValueError):
        raise ConfigError(f"generation setting {name}={value!r} cannot be logged (not JSON)") from None


def resolve_settings(model: Any, prompt_len: int, generation_config: Any = None,
                     **kwargs: Any) -> GenerationSettings:
    """The settings ``model.generate(ids, generation_config, **kwargs)`` would run with, for a prompt of
    ``prompt_len`` ids; ``seed`` and ``eos_token_ids`` (the Session's own spelling) are also taken."""
    kwargs = dict(kwargs)
    seed = kwargs.pop("seed", None)
    if "eos_token_ids" in kwargs:
        if "eos_token_id" in kwargs:
            raise ConfigError("pass eos_token_id or eos_token_ids, not both")
        eos = kwargs.pop("eos_token_ids")
        kwargs["eos_token_id"] = None if eos is None else ([int(eos)] if isinstance(eos, int) else list(eos))
    for name, why in REFUSED_ARGS.items():
        if kwargs.get(name) is not None:
            raise ConfigError(f"generate() argument {name!r} is not supported by Session: {why}")
        kwargs.pop(name, None)
    mask = kwargs.pop("attention_mask", None)
    if mask is not None and not bool(torch.as_tensor(mask).bool().all()):
        raise ConfigError("attention_mask with zeros (padding) is not supported: a Session holds one unpadded "
                          "sequence; pass the ids without padding")
    if generation_config is None:
        for k, v in SESSION_DEFAULTS.items():
            if k == "max_new_tokens" and kwargs.get("max_length") is not None:
                continue
            if kwargs.get(k) is None:
                kwargs[k] = v
    has_default_max = (kwargs.get("max_length") is None
                       and (generation_config is None or generation_config.max_length is None)
                       and model.generation_config.max_length is None)
    has_default_min = (kwargs.get("min_length") is None
                       and (generation_config is None or generation_config.min_length is None)
                       and model.generation_config.min_length is None)
    try:
        gc, unused = model._prepare_generation_config(generation_config, **kwargs)
    except (ValueError, TypeError) as e:
        raise ConfigError(f"generation settings refused by transformers: {e}") from None
    _refuse_unsupported(gc, unused, kwargs)
    ids = torch.zeros((1, prompt_len), dtype=torch.long)
    gc = model._prepare_generated_length(generation_config=gc, has_default_max_length=has_default_max,
                                         has_default_min_length=has_default_min, model_input_name="input_ids",
                                         input_ids_length=prompt_len, inputs_tensor=ids)
    max_new = int(gc.max_length) - prompt_len
    if max_new < 1:
        raise ConfigError(f"max_length={gc.max_length} leaves no new token after a prompt of {prompt_len} "
                          "tokens: pass max_new_tokens")
    d = gc.to_dict()
    cfg = {k: _jsonable(k, d.get(k)) for k in SUPPORTED if k in d}
    cfg["max_new_tokens"] = max_new
    return GenerationSettings(cfg, prompt_len, max_new, None if seed is None else int(seed))


def _refuse_unsupported(gc: Any, unused: Mapping[str, Any], passed: Mapping[str, Any]) -> None:
    fields = _reference_defaults()
    bad = sorted(k for k in unused if k not in fields and k not in ("output_attentions", "output_hidden_states"))
    if bad:
        raise ConfigError(f"unknown generation setting{'s' if len(bad) > 1 else ''} {', '.join(map(repr, bad))}: "
                          "not a GenerationConfig field nor a generate() argument")
    if gc.use_cache is False:
        raise ConfigError("use_cache=False is not supported: a Session decodes through its logged KV cache")
    d = gc.to_dict()
    for k, v in d.items():
        if k in SUPPORTED or k in IGNORED or k not in fields or v == fields[k] or not (v or fields[k]):
            continue
        source = "you passed it" if k in passed else "the model's generation_config (or the one passed) sets it"
        raise ConfigError(
            f"generation setting {k}={v!r} is not supported by Session ({source}); supported: "
            f"{', '.join(SUPPORTED)}. Pass {k}={fields[k]!r} to override, or use model.generate()")


@dataclass
class GenerationRules:
    """transformers' processors and stopping criteria for one generate() call (rebuilt after a recovery)."""

    processors: Any
    criteria: Any  # the criteria beyond max length and eos (which the loop checks itself): stop strings
    eos: frozenset[int]
    max_new_tokens: int
    do_sample: bool


def plan_rules(model: Any, settings: GenerationSettings, prompt: torch.Tensor, tokenizer: Any = None,
               *, device: Any = None) -> GenerationRules:
    """Build the rules with the methods generate() uses; ``prompt`` is the (1, prompt_len) ids tensor."""
    from transformers.generation.logits_process import LogitsProcessorList
    from transformers.generation.stopping_criteria import (
        EosTokenCriteria,
        MaxLengthCriteria,
        StoppingCriteriaList,
    )

    gc = copy.deepcopy(settings.generation_config())
    if gc.stop_strings is not None and tokenizer is None:
        raise ConfigError(f"stop_strings={gc.stop_strings!r} needs the model's tokenizer: create the Session (or "
                          "call Session.recover) with tokenizer=...")
    device = prompt.device if device is None else device
    if gc.eos_token_id is not None and not isinstance(gc.eos_token_id, int) and len(gc.eos_token_id) == 0:
        gc.eos_token_id = None  # "no end-of-sequence token" (eos_token_ids=()): transformers indexes an empty list
    model._prepare_special_tokens(gc, False, device=device, batch_size=1)
    procs = model._get_logits_processor(
        generation_config=gc, input_ids_seq_length=settings.prompt_len, encoder_input_ids=prompt,
        prefix_allowed_tokens_fn=None, logits_processor=LogitsProcessorList(), device=device, model_kwargs={},
        negative_prompt_ids=None, negative_prompt_attention_mask=None)
    every = model._get_stopping_criteria(generation_config=gc, stopping_criteria=StoppingCriteriaList(),
                                         tokenizer=tokenizer)
    rest = StoppingCriteriaList(c for c in every if not isinstance(c, (MaxLengthCriteria, EosTokenCriteria)))
    return GenerationRules(procs, rest, frozenset(settings.eos_token_ids), settings.max_new_tokens,
                           settings.do_sample)


def pick_token(rules: GenerationRules, seq: torch.Tensor | None, logits: torch.Tensor,
               generator: torch.Generator) -> tuple[int, torch.Tensor]:
    """generate()'s step for one sequence: processors, then softmax + multinomial or argmax."""
    scores = rules.processors(seq, logits) if len(rules.processors) else logits
    if rules.do_sample:
        probs = torch.nn.functional.softmax(scores, dim=-1)
        return int(torch.multinomial(probs, num_samples=1, generator=generator).item()), scores
    return int(torch.argmax(scores, dim=-1).item()), scores


def should_stop(rules: GenerationRules, tok: int, n_new: int, seq: torch.Tensor | None,
                scores: torch.Tensor) -> bool:
    """After ``tok`` (the ``n_new``-th new token, already in ``seq``): the generation ends here."""
    if tok in rules.eos or n_new >= rules.max_new_tokens:
        return True
    return bool(len(rules.criteria)) and bool(rules.criteria(seq, scores).any())


def needs_ids(rules: GenerationRules) -> bool:
    """Whether the rules read the token ids (the loop then builds the ids tensor each step)."""
    return bool(len(rules.processors)) or bool(len(rules.criteria))


__all__ = ["GenerationRules", "GenerationSettings", "needs_ids", "pick_token", "plan_rules", "resolve_settings",
           "should_stop"]


# ------------------------------------------------------------------------------------------ the sampler
# The sampler's generator state is logged as one device-independent record of a fixed size (the region is
# the same size whichever device wrote it or reads it back): a 64-byte header (magic, the device type whose
# generator the state belongs to, the state's length) and the state's bytes: 16 for a CUDA generator (Philox
# seed + offset), 5056 for a CPU one (Mersenne Twister).
SAMPLER_MAGIC = b"CFTSMPL1"
SAMPLER_HEADER_BYTES = 64
SAMPLER_BYTES = 5120  # 10 blocks of 512: the header + a CPU generator's state


def encode_sampler_state(generator: torch.Generator, out: Any) -> None:
    """Write ``generator``'s state as a sampler record into ``out`` (a uint8 numpy array of SAMPLER_BYTES)."""
    state = generator.get_state().numpy()
    n = int(state.nbytes)
    if n > SAMPLER_BYTES - SAMPLER_HEADER_BYTES:
        raise ConfigError(f"the {generator.device.type} generator's state is {n} bytes; a sampler record holds "
                          f"{SAMPLER_BYTES - SAMPLER_HEADER_BYTES}")
    kind = generator.device.type.encode()[:16]
    header = SAMPLER_MAGIC + kind.ljust(16, b"\0") + n.to_bytes(4, "little")
    out[: len(header)] = memoryview(header)
    out[len(header): SAMPLER_HEADER_BYTES] = 0
    out[SAMPLER_HEADER_BYTES: SAMPLER_HEADER_BYTES + n] = state
    out[SAMPLER_HEADER_BYTES + n:] = 0


def decode_sampler_state(record: Any) -> tuple[str, bytes] | None:
    """(device type, state bytes) of a sampler record; None when none was ever written (all zeros)."""
    raw = bytes(record[:SAMPLER_HEADER_BYTES])
    if raw[:8] != SAMPLER_MAGIC:
        if not any(raw):
            return None
        raise RecoveryError(f"the logged sampler record starts with {raw[:8]!r}, not {SAMPLER_MAGIC!r}: damaged, "
                            "or written by a newer concordia_ft")
    kind = raw[8:24].rstrip(b"\0").decode()
    n = int.from_bytes(raw[24:28], "little")
    return kind, bytes(record[SAMPLER_HEADER_BYTES: SAMPLER_HEADER_BYTES + n])


def restore_sampler_state(generator: torch.Generator, kind: str, state: bytes) -> bool:
    """Put a logged state into ``generator``. True: the same stream continues (same device type). False: the
    state belongs to another device type's generator (CUDA Philox vs CPU Mersenne Twister), whose stream this
    one cannot continue; it is seeded from a hash of that state instead, so every recovery of the same log on
    this device type draws the same (but different from the writer's) samples."""
    if kind == generator.device.type:
        generator.set_state(torch.frombuffer(bytearray(state), dtype=torch.uint8))
        return True
    import hashlib

    digest = hashlib.sha256(b"concordia_ft sampler " + kind.encode() + b" " + state).digest()
    generator.manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))
    return False


__all__ += ["SAMPLER_BYTES", "decode_sampler_state", "encode_sampler_state", "restore_sampler_state"]
