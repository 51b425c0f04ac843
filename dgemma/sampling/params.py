"""Per-request sampling parameters: published defaults, validation, and the one place a checkpoint's
`generation_config.json` enters (`SamplingParams.from_generation_config`)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from dgemma.errors import SamplingParamsError
from dgemma.knobs import KNOBS
from dgemma.options import OPTIONS, check_modes
from dgemma.sampling.constraints import Grammar
from dgemma.sampling.layout import Layout
from dgemma.sampling.thinking import ThoughtBudget

MAX_NEW_TOKENS = 1_000_000
MAX_DENOISING_STEPS = 10_000
MAX_SEED = 2**64 - 1
MAX_LOGPROBS = 20  # alternatives per token, as OpenAI's API allows
MAX_SOFT_TOP_K = 1 << 20
OFF = {k.option.name: k.off for k in KNOBS}  # a knob's values that change nothing


@dataclass(frozen=True)
class Limits:
    """Caps a deployment puts on requests (the server's flags); None: only the model's own limits."""

    max_prompt_tokens: int | None = None
    max_new_tokens: int | None = None
    max_stop: int | None = None
    max_stop_chars: int | None = None
    max_cache_bytes: int | None = None  # KV cache one request may need (prompt + max_new_tokens + a canvas)
    # fairness: what one request may cost the others (diffusion: its rows ride in every decoder pass it runs)
    max_denoising_steps: int | None = None  # per canvas
    max_temperature: float | None = None  # t_max (so the whole schedule) and ar_temperature
    max_token_steps: int | None = None  # max_new_tokens x max_denoising_steps: the decoder work a request may ask

    def clamp(self, defaults: SamplingParams) -> SamplingParams:
        """`defaults` (the checkpoint's) within the caps, so that a request leaving a field out is not refused."""
        steps, t = self.max_denoising_steps, self.max_temperature
        out = defaults.replace(max_denoising_steps=None if steps is None else min(steps, defaults.max_denoising_steps))
        if t is None:
            return out
        return out.replace(t_max=min(t, out.t_max), t_min=min(t, out.t_min), ar_temperature=min(t, out.ar_temperature))


def _with_options(cls):
    """One field per declared option (options.OPTIONS), None by default: its declaration is its only mention."""
    for o in OPTIONS:
        cls.__annotations__[o.name] = f"{o.type.__name__} | None"
        setattr(cls, o.name, None)
    return cls


@dataclass(frozen=True)
@_with_options
class SamplingParams:
    """Defaults are HF's `_get_default_generation_params` (also the released checkpoint's values).

    Temperature at denoising step s (steps remaining, N..1) is t_min + (t_max - t_min) * s / N.
    Unlike HF (which rejects t_max == t_min), a constant schedule t_max == t_min > 0 is allowed.
    Besides the fields below, every option of `options.OPTIONS` is a field (None: off).
    """

    max_new_tokens: int = 256
    max_denoising_steps: int = 48
    entropy_bound: float = 0.1
    t_min: float = 0.4
    t_max: float = 0.8
    stability_threshold: int = 1
    confidence_threshold: float = 0.005
    seed: int | None = None
    stop: tuple[str, ...] = ()
    eos_token_ids: tuple[int, ...] | None = None  # None: the model's
    ar_temperature: float = 0.0  # autoregressive and speculative modes only; 0 is greedy
    grammar: Grammar | None = None  # the output must match it (sampling/constraints.py)
    layout: Layout | None = None  # fixed tokens and holes (sampling/layout.py); sets max_new_tokens
    logprobs: int | None = None  # report log-probabilities with this many alternatives (sampling/logprobs.py)
    cache_salt: str | None = None  # prefix-cache partition: only prefixes cached under the same salt are reused
    thought_budget: ThoughtBudget | None = None  # max_thinking_tokens: a thought closes within it (sampling/thinking.py)

    def __post_init__(self) -> None:
        # Normalise containers so the object stays hashable: a bare str / int means a 1-tuple.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif not isinstance(self.stop, tuple):
            object.__setattr__(self, "stop", tuple(self.stop))
        eos = self.eos_token_ids
        if eos is not None and not isinstance(eos, tuple):
            object.__setattr__(self, "eos_token_ids", (eos,) if _is_int(eos) else tuple(eos))
        if isinstance(self.layout, Layout):
            object.__setattr__(self, "max_new_tokens", max(1, len(self.layout.tokens)))
        for o in OPTIONS:
            if o.normalize is not None and getattr(self, o.name) is not None:
                object.__setattr__(self, o.name, o.normalize(getattr(self, o.name)))
        self._check()

    def _check(self) -> None:
        _int_in("max_new_tokens", self.max_new_tokens, 1, MAX_NEW_TOKENS)
        _int_in("max_denoising_steps", self.max_denoising_steps, 1, MAX_DENOISING_STEPS)
        _int_in("stability_threshold", self.stability_threshold, 0, None)
        _positive("entropy_bound", self.entropy_bound)
        _positive("confidence_threshold", self.confidence_threshold)
        _non_negative("t_min", self.t_min)
        _positive("t_max", self.t_max)
        _non_negative("ar_temperature", self.ar_temperature)
        if self.t_max < self.t_min:
            _fail(f"t_max={self.t_max} must be >= t_min={self.t_min}", "t_max")
        if self.seed is not None:
            _int_in("seed", self.seed, 0, MAX_SEED)
        if not all(isinstance(s, str) and s for s in self.stop):
            _fail(f"stop={self.stop!r} must be non-empty strings", "stop")
        if self.eos_token_ids is not None and not all(_is_int(i) and i >= 0 for i in self.eos_token_ids):
            _fail(f"eos_token_ids={self.eos_token_ids!r} must be non-negative integers", "eos_token_ids")
        if self.grammar is not None:
            if not isinstance(self.grammar, Grammar):
                _fail("grammar must be a dgemma.Grammar (Grammar.json_schema(...), .regex(...), ...)", "grammar")
            self.grammar.check()
        if self.cache_salt is not None and not isinstance(self.cache_salt, str):
            _fail(f"cache_salt={self.cache_salt!r} must be a string", "cache_salt")
        if self.logprobs is not None:
            _int_in("logprobs", self.logprobs, 0, MAX_LOGPROBS)
            if self.layout is not None:
                _fail("logprobs with a suffix, template or edit are not supported", "logprobs")
        self._check_thought_budget()
        self._check_speed()
        self._check_savings()
        for o in OPTIONS:
            if o.check is not None and getattr(self, o.name) is not None:
                o.check(getattr(self, o.name), None)
        if self.layout is not None:
            if not isinstance(self.layout, Layout):
                _fail("layout must be a dgemma.sampling.layout.Layout", "layout")
            self.layout.check()
            if self.grammar is not None:
                _fail("a grammar and a layout canvas (suffix, template, edit) cannot be combined", self.layout.param)

    def _check_speed(self) -> None:
        """early_commit: steps a position must stay unchanged; it commits text before the canvas ends, which a
        grammar's or a layout's whole-canvas rules cannot follow; early_commit_cache: its frozen prefix moves into the
        KV cache (a pass narrower than the canvas, which settled_kv_reuse's kept positions do not index);
        early_first_token: the same text before the canvas ends, and the same exclusions. early_stop:
        an entropy threshold; target_canvas_ms: a canvas's wall time in milliseconds."""
        if self.early_stop is not None:
            _positive("early_stop", self.early_stop)
        if self.target_canvas_ms is not None:
            _positive("target_canvas_ms", self.target_canvas_ms)
        if self.early_commit_cache is not None:
            if not isinstance(self.early_commit_cache, bool):
                _fail(f"early_commit_cache={self.early_commit_cache!r} must be true or false", "early_commit_cache")
            if self.early_commit_cache and (self.early_commit is None or self.settled_kv_reuse):
                _fail("early_commit_cache needs early_commit and no settled_kv_reuse", "early_commit_cache")
        if self.early_first_token is not None:
            if not isinstance(self.early_first_token, bool):
                _fail(f"early_first_token={self.early_first_token!r} must be true or false", "early_first_token")
            if self.early_first_token and (self.grammar is not None or self.layout is not None):
                _fail("early_first_token cannot be combined with a grammar or a suffix, template or edit",
                      "early_first_token")
        if self.early_commit is None:
            return
        _int_in("early_commit", self.early_commit, 1, MAX_DENOISING_STEPS)
        if self.grammar is not None or self.layout is not None:
            _fail("early_commit cannot be combined with a grammar or a suffix, template or edit", "early_commit")

    def _check_thought_budget(self) -> None:
        if self.thought_budget is None:
            return
        if not isinstance(self.thought_budget, ThoughtBudget):
            _fail("thought_budget must be a dgemma.sampling.thinking.ThoughtBudget", "max_thinking_tokens")
        self.thought_budget.check()
        if self.layout is not None or self.early_commit_cache:
            _fail("max_thinking_tokens cannot be combined with a suffix, template, edit or early_commit_cache",
                  "max_thinking_tokens")

    def _check_savings(self) -> None:
        if self.soft_top_k is not None:
            _int_in("soft_top_k", self.soft_top_k, 1, MAX_SOFT_TOP_K)
        if self.skip_settled is not None:
            _int_in("skip_settled", self.skip_settled, 1, MAX_DENOISING_STEPS)
            if self.grammar is not None or self.layout is not None:
                _fail("skip_settled with a grammar, suffix, template or edit is not supported", "skip_settled")
        if self.settled_kv_reuse is not None:
            if not isinstance(self.settled_kv_reuse, bool):
                _fail(f"settled_kv_reuse={self.settled_kv_reuse!r} must be true or false", "settled_kv_reuse")
            if self.settled_kv_reuse and (self.skip_settled is None or self.logprobs is not None):
                _fail("settled_kv_reuse needs skip_settled and no logprobs", "settled_kv_reuse")

    def check_decoding(self, mode: str, sampling: str, eos: tuple[int, ...], tokenizer: bool) -> None:
        """What a request asks of its decoding (`mode`, `sampling`) and of the checkpoint (its end-of-sequence ids
        `eos`, whether it has a `tokenizer` for grammars): checked by the API before a request is made and by every
        engine (EngineBase.make_request). Which field applies to which mode: `options.check_modes`."""
        g, s, fast_diffusion = self.grammar, self.layout, (mode, sampling) == ("diffusion", "fast")
        for broken, message, param in (
                (g and sampling != "fast", "constrained output needs the fast sampler", g and g.param),
                (g and not tokenizer, "constrained output needs a tokenizer; this checkpoint has none", g and g.param),
                (g and not eos, "constrained output needs an end-of-sequence token", g and g.param),
                (s and not fast_diffusion, "a suffix, template or edit needs fast diffusion decoding", s and s.param),
                (s and not eos, "a suffix, template or edit needs an end-of-sequence token", s and s.param)):
            if broken:
                _fail(message, param)
        check_modes(self.asked(), mode, sampling)

    def asked(self) -> list[str]:
        """The fields that are off unless set, set to something other than off (the thinking budget by its request
        name, max_thinking_tokens)."""
        values = {n: getattr(self, n) for n in ("logprobs", *(o.name for o in OPTIONS))}
        values["max_thinking_tokens"] = self.thought_budget
        return [n for n, v in values.items() if v is not None and v is not False and v not in OFF.get(n, ())]

    def validate(self, vocab_size: int | None = None, max_context: int | None = None, prompt_len: int = 0,
                 limits: Limits = Limits(), cache_bytes: Callable[[int], int] | None = None) -> None:
        """Checks that need the model or the deployment: eos ids inside the vocabulary, prompt + output inside
        the context, and the deployment's caps (`cache_bytes`: the model's KV-cache bytes for a context)."""
        if self.layout is not None:
            self.layout.check(vocab_size)
        for o in OPTIONS:
            if o.check is not None and getattr(self, o.name) is not None:
                o.check(getattr(self, o.name), vocab_size)
        if vocab_size is not None and self.eos_token_ids and max(self.eos_token_ids) >= vocab_size:
            _fail(f"eos_token_ids={self.eos_token_ids!r} outside the vocabulary (size {vocab_size})", "eos_token_ids")
        check_length("prompt", prompt_len, limits.max_prompt_tokens)
        _cap("max_new_tokens", self.max_new_tokens, limits.max_new_tokens, "max_new_tokens ({}) exceeds the limit ({})")
        _cap("stop", len(self.stop), limits.max_stop, "{} stop strings; at most {} are allowed")
        for s in self.stop:
            _cap("stop", len(s), limits.max_stop_chars, "a stop string has {} characters; at most {} are allowed")
        self._check_fairness(limits)
        if max_context is not None and prompt_len >= max_context:
            _fail(f"the prompt has {prompt_len} tokens; the context ({max_context} tokens) leaves no room for "
                  "new ones", "prompt")
        if max_context is not None and prompt_len + self.max_new_tokens > max_context:
            _fail(f"prompt ({prompt_len} tokens) + max_new_tokens ({self.max_new_tokens}) exceeds the context "
                  f"({max_context} tokens)", "max_new_tokens")
        if limits.max_cache_bytes is not None and cache_bytes is not None:
            need = cache_bytes(prompt_len + self.max_new_tokens)
            if need > limits.max_cache_bytes:
                _fail(f"prompt ({prompt_len} tokens) + max_new_tokens ({self.max_new_tokens}) needs {need / 2**20:.1f} "
                      f"MiB of KV cache; the limit is {limits.max_cache_bytes / 2**20:.1f} MiB", "max_new_tokens")

    def _check_fairness(self, limits: Limits) -> None:
        """The deployment's caps on denoising steps, temperatures and decoder work per request."""
        _cap("max_denoising_steps", self.max_denoising_steps, limits.max_denoising_steps,
             "max_denoising_steps ({}) exceeds the limit ({})")
        for name in ("t_max", "ar_temperature"):
            _cap(name, getattr(self, name), limits.max_temperature, "the temperature ({}) exceeds the limit ({})")
        work = self.max_new_tokens * self.max_denoising_steps
        if limits.max_token_steps is not None and work > limits.max_token_steps:
            _fail(f"max_new_tokens ({self.max_new_tokens}) x max_denoising_steps ({self.max_denoising_steps}) = "
                  f"{work} token-steps exceeds the limit ({limits.max_token_steps}); ask fewer tokens or steps",
                  "max_new_tokens")

    def replace(self, **overrides: Any) -> SamplingParams:
        """A copy with `overrides` applied; None values mean "keep" (request fields left unset)."""
        if unknown := overrides.keys() - {f.name for f in dataclasses.fields(self)}:
            _fail(f"unknown sampling parameter(s): {', '.join(sorted(unknown))}", sorted(unknown)[0])
        return dataclasses.replace(self, **{k: v for k, v in overrides.items() if v is not None})

    @classmethod
    def from_generation_config(cls, cfg: dict[str, Any]) -> SamplingParams:
        """From a checkpoint's `generation_config.json` dict; missing or null keys keep the defaults."""
        sampler = cfg.get("sampler_config") or {}
        return cls().replace(
            max_new_tokens=cfg.get("max_new_tokens"),
            max_denoising_steps=cfg.get("max_denoising_steps"),
            entropy_bound=sampler.get("entropy_bound"),
            t_min=cfg.get("t_min"),
            t_max=cfg.get("t_max"),
            stability_threshold=cfg.get("stability_threshold"),
            confidence_threshold=cfg.get("confidence_threshold"),
            eos_token_ids=cfg.get("eos_token_id"),
        )


def _fail(message: str, param: str) -> None:
    raise SamplingParamsError(message, param)


def check_length(param: str, size: int, cap: int | None, unit: str = "tokens", fits: int | None = None) -> None:
    """The length rule of a prompt or a layout canvas's text: at most `cap` tokens (None: no cap). `size` counts
    `unit`s; a text counted in characters before it is tokenized is held to `fits`, the most characters `cap` tokens
    can hold."""
    if cap is not None and size > (cap if fits is None else fits):
        fit = "" if fits is None else f", which no text over {fits} characters fits in"
        _fail(f"the {param} has {size} {unit}; at most {cap} tokens are allowed{fit}", param)


def _cap(param: str, value: float, cap: float | None, message: str) -> None:
    if cap is not None and value > cap:
        _fail(message.format(value, cap), param)


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_real(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _int_in(name: str, value: Any, lo: int, hi: int | None) -> None:
    if not _is_int(value) or value < lo or (hi is not None and value > hi):
        bound = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        _fail(f"{name}={value!r} must be an integer {bound}", name)


def _positive(name: str, value: Any) -> None:
    if not _is_real(value) or value <= 0:
        _fail(f"{name}={value!r} must be a finite number > 0", name)


def _non_negative(name: str, value: Any) -> None:
    if not _is_real(value) or value < 0:
        _fail(f"{name}={value!r} must be a finite number >= 0", name)
