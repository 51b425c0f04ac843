"""Python API: `dgemma.load(...)` returns a `Model` whose `generate` / `stream` take text, chat messages (with
tools) or ids."""

from __future__ import annotations

import random
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from dgemma import images
from dgemma.cache import KVCache
from dgemma.chat.tools import ToolUse
from dgemma.dtypes import native_bf16, parse_dtype
from dgemma.engine import (AutoregressiveEngine, Engine, OutputStream, PrefixCache, ReferenceRunner, Result,
                           SpeculativeEngine, StreamEvent)
from dgemma.errors import DgemmaError
from dgemma.jsonfile import read_json
from dgemma.options import MODES, SAMPLINGS
from dgemma.quant import QuantizedWeight, a8, int4cpu, kernel_summary, parse_quantize
from dgemma.quant import summary as quant_summary
from dgemma.sampling import Limits, SamplingParams, SamplingParamsError
from dgemma.sampling.params import check_length
from dgemma.sampling.constraints import GrammarVocab, shared_vocab
from dgemma.sampling.fused import vocab_chunk
from dgemma.sampling.seeded import Layout, edit_parts, parse_template, renoised_positions
from dgemma.tokenizer import Tokenizer
from dgemma.weights import is_gguf, load_gguf_model, load_model, resolve_checkpoint

DEMO_MODEL = Path(__file__).parent / "assets" / "demo"

Prompt = str | list[int] | list[dict[str, Any]]
CHAR_MARGIN = 2  # a token can cover more characters than its own text after normalisation (NFKC): stay safe


def load(path_or_repo: str | Path | None = None, dtype: str | torch.dtype = "auto",
         device: str | torch.device = "cpu", compile: bool = False, quantize: str | None = None) -> Model:
    """Load a checkpoint directory, a cached Hugging Face repo id or a GGUF file of llama.cpp's diffusion-gemma
    architecture (default: the bundled demo model).
    `compile`: run the denoising pass (the per-step body) through torch.compile; off, nothing changes.
    `quantize`: "int8" | "int4" (see `dgemma.quant.spec` for group sizes and the embedding): weight-only
    quantization while loading, tensor by tensor with plain file reads (not the memory map). A GGUF file keeps
    its quantized tensors compact without it (see `dgemma.weights.gguf_load`); with it, they are re-quantized to
    that scheme."""
    spec = parse_quantize(quantize)
    if path_or_repo is None:
        if not (DEMO_MODEL / "config.json").is_file():
            raise DgemmaError("the bundled demo model is missing from this install; pass --model PATH")
        path_or_repo = DEMO_MODEL
    gguf = is_gguf(path_or_repo)
    directory = Path(path_or_repo).expanduser() if gguf else resolve_checkpoint(path_or_repo)
    device = _device(device)
    if spec is not None and device.type not in QUANT_DEVICES:
        raise DgemmaError(f"quantize={spec.name} runs on {' or '.join(QUANT_DEVICES)}, not on device {device}")
    if spec is not None and spec.int8_activations and not a8.available(device):
        raise DgemmaError(f"quantize={spec.name}: int8 activations need an x86 CPU build of PyTorch with oneDNN, "
                          f"not device {device}")
    stored = spec if spec is None or spec.requantizes else None
    if gguf:
        module, tokenizer, generation = load_gguf_model(directory, _resolve_dtype(dtype, directory, device), device,
                                                        stored)
    else:
        module = load_model(directory, _resolve_dtype(dtype, directory, device), device, stored)
        tokenizer, generation = Tokenizer.maybe_load(directory), read_json(directory / "generation_config.json")
    if device.type == "cpu" and int4cpu.available():
        int4cpu.convert(module)
    if spec is not None and spec.int8_activations and not a8.enable(module, module.embed_tokens.weight,
                                                                     vocab_chunk(device)):
        raise DgemmaError(f"quantize={spec.name}: {directory} has no quantized 2D weights to run with int8 "
                          "activations (int8+a8 or int4+a8 quantizes them while loading)")
    if compile:
        # dynamic shapes: the cache view grows every canvas; a new batch size compiles once more
        module.denoise = torch.compile(module.denoise, dynamic=True)
    return Model(module, tokenizer, directory, generation)


def load_model_from_args(args) -> Model:
    """`load` with the options commands share (`options.add_model_options`)."""
    return load(args.model, dtype=args.dtype, device=args.device, compile=args.compile, quantize=args.quantize)


def _device(device: str | torch.device) -> torch.device:
    try:
        device = torch.device(device)
        torch.empty(0, device=device)
    except (RuntimeError, AssertionError) as e:
        raise DgemmaError(f"device {device!s} is not available ({e})") from None
    return device


QUANT_DEVICES = ("cpu", "cuda")  # where the decode ops (bit shifts on uint8, int8 casts) are known to run
AUTO_FLOAT32_BYTES = 4 << 30  # "auto" upcasts bf16 checkpoints up to this size where bf16 is slow


def _resolve_dtype(dtype: str | torch.dtype, directory: Path, device: torch.device) -> torch.dtype:
    if dtype == "auto" and directory.is_file():  # GGUF: dequantised weights compute in float32 without native bf16
        return torch.bfloat16 if native_bf16(device.type) else torch.float32
    if dtype == "auto":
        config = read_json(directory / "config.json")  # {} when missing: load_model then says so
        saved = config.get("dtype") or config.get("torch_dtype")
        if saved != "bfloat16":
            return torch.float32
        small = sum(f.stat().st_size for f in directory.glob("*.safetensors")) <= AUTO_FLOAT32_BYTES
        return torch.float32 if small and not native_bf16(device.type) else torch.bfloat16
    return parse_dtype(dtype)


class Model:
    def __init__(self, module, tokenizer: Tokenizer | None, directory: Path, generation_config: dict | None = None):
        self.module = module  # the DiffusionGemma torch module
        self.tokenizer = tokenizer
        self.directory = directory  # the checkpoint directory, or the GGUF file
        text = module.cfg.text
        if generation_config is None:
            generation_config = read_json(directory / "generation_config.json")
        self.defaults = SamplingParams.from_generation_config(generation_config)
        if self.defaults.eos_token_ids is None:
            self.defaults = self.defaults.replace(eos_token_ids=text.eos_token_id)
        self.pad_id = text.pad_token_id
        self.max_context = text.max_position_embeddings
        self.image_limits = images.ImageLimits()  # per-request caps on image inputs (the server sets its own)
        # kept across generate / stream calls: a prompt that starts with an earlier prompt and answer (a chat's next
        # turn) continues from a copy of their cache (`dgemma chat` sets one); None: every call encodes its prompt
        self.prefix_cache: PrefixCache | None = None

    # ---- inputs -----------------------------------------------------------------------------------------
    def encode_prompt(self, prompt: Prompt, max_tokens: int | None = None,
                      tools: ToolUse | list[dict[str, Any]] | None = None, partition: str | None = None) -> list[int]:
        """Text, chat messages (rendered with `tools`: OpenAI tool objects or a chat.tools.ToolUse) or ids -> ids.
        With `max_tokens`, a prompt that cannot fit in that many tokens (more characters than that many of the
        longest token hold, x CHAR_MARGIN) is refused before any tokenizing, so its cost is bounded by the limit,
        not by its length. `partition`: whose prompt this is (an API key, a cache salt): images are cached apart."""
        if isinstance(prompt, (str, list)) and not prompt:
            self.check_ids([])  # refused there: an empty text would still tokenize to a BOS
        chat = _is_chat(prompt)
        if chat:
            tools = tools if isinstance(tools, ToolUse) else ToolUse.of(tools, None, None, None, False, self.tokenizer)
            prompt = tools.messages(list(prompt))
        if max_tokens is not None:
            self._check_length(prompt, max_tokens)
        if isinstance(prompt, str):
            ids = self._require_tokenizer().encode(prompt)
        elif images.has_parts(prompt):  # checks its text ids itself: image soft tokens lie past the vocabulary
            return images.prompt_ids(self, prompt, tools.declared, self.image_limits, partition)
        elif chat:
            ids = self._require_tokenizer().encode_chat(prompt, tools.declared)
        elif isinstance(prompt, Sequence) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            ids = list(prompt)
        else:
            raise SamplingParamsError("a prompt is text, a list of chat messages, or a list of token ids", "prompt")
        return self.check_ids(ids)

    def prompt_limit(self, limits: Limits = Limits()) -> int:
        """The most tokens a prompt may have: the context less one new token, and the deployment's cap."""
        return min(self.max_context - 1, limits.max_prompt_tokens or self.max_context)

    def _check_length(self, prompt: Prompt, max_tokens: int | None = None, param: str = "prompt") -> None:
        """A prompt, or a seeded canvas's text (suffix, template, draft), that cannot fit in `max_tokens` (default:
        the context) is refused untokenized."""
        max_tokens = max_tokens or self.max_context
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return check_length(param, len(prompt), max_tokens)
        per_token = self.tokenizer.max_token_chars if self.tokenizer is not None else 1
        check_length(param, _chars(prompt), max_tokens, "characters", max_tokens * per_token * CHAR_MARGIN)

    def check_ids(self, ids: list[int]) -> list[int]:
        vocab = self.module.cfg.text.vocab_size
        if not ids:
            raise SamplingParamsError("empty prompt", "prompt")
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise SamplingParamsError(f"token id {bad[0]} is outside the vocabulary (0..{vocab - 1})", "prompt")
        if self.module.cfg.image_token_id in ids:
            raise SamplingParamsError(f"the prompt's ids contain the image token ({self.module.cfg.image_token_id}): "
                                      "send images as image parts of chat messages", "prompt")
        return ids

    def _require_tokenizer(self) -> Tokenizer:
        if self.tokenizer is None:
            raise DgemmaError("this checkpoint has no tokenizer.json; pass token ids instead of text")
        return self.tokenizer

    def params(self, **options: Any) -> SamplingParams:
        """SamplingParams fields, plus the seeded-canvas options: `suffix` (infill: the output is the text
        between the prompt and this suffix, at most max_new_tokens), `template` (text with [[hole]] /
        [[hole:N]] holes; the output is the filled template), `edit` (a draft, text or ids) with `renoise`
        (a fraction of its tokens chosen by the seed, or (start, end) spans: characters of a text draft, indices
        of an id draft). `layout_limit`: the most tokens a template or edit may have (default: the context); a
        longer one is refused before it is tokenized or built."""
        seeded = {k: options.pop(k) for k in ("suffix", "template", "edit", "renoise") if k in options}
        limit = min(self.max_context, options.pop("layout_limit", None) or self.max_context)
        if any(v is not None for v in seeded.values()):
            options["seeded"] = self._layout(options, limit, **seeded)
        return self.defaults.replace(**options)

    def cache_bytes(self, tokens: int) -> int:
        """KV-cache bytes a request with this many prompt + new tokens needs (one canvas more while denoising)."""
        m = self.module
        return KVCache.bytes_for(m.cfg.text, tokens + m.cfg.canvas_length, m.dtype, m.cfg.canvas_length)

    def _layout(self, options: dict[str, Any], limit: int, suffix: str | None = None, template: str | None = None,
                edit: str | list[int] | None = None, renoise: float | list[tuple[int, int]] | None = None) -> Layout:
        given = [k for k, v in (("suffix", suffix), ("template", template), ("edit", edit)) if v is not None]
        if len(given) != 1 or (renoise is None) != (edit is None):
            raise SamplingParamsError("give one of suffix, template, or edit with renoise", (given or ["edit"])[-1])
        if suffix is not None:
            hole = options.get("max_new_tokens")
            hole = self.defaults.max_new_tokens if hole is None else hole
            return Layout.from_parts([hole, self._text_ids(suffix, "suffix")], echo=False, param="suffix")
        if template is not None:
            self._check_length(template, limit, "template")
            parts = parse_template(template, limit)
            return Layout.from_parts([p if isinstance(p, int) else self._text_ids(p, "template") for p in parts],
                                     limit=limit)
        ids, offsets = (edit, [(i, i + 1) for i in range(len(edit))]) if isinstance(edit, list) else \
            self._text_offsets(edit, limit)
        if isinstance(renoise, (int, float)):
            if not 0 < renoise <= 1:
                raise SamplingParamsError(f"renoise={renoise} must be a fraction in (0, 1]", "renoise")
            rng = random.Random(options.get("seed") or 0)
            chosen = set(rng.sample(range(len(ids)), max(1, round(renoise * len(ids)))))
        else:
            chosen = renoised_positions(offsets, renoise)
        return Layout.from_parts(edit_parts(self.check_ids(list(ids)), chosen), param="edit", limit=limit)

    def token_bytes(self, token_id: int) -> bytes:
        """A token's raw bytes (a piece of a multi-byte character stays a piece)."""
        return self.grammar_vocab().tokenizer.decode_bytes([token_id])

    def _text_ids(self, text: str, param: str) -> list[int]:
        if not isinstance(text, str) or not text:
            raise SamplingParamsError(f"{param} must be a non-empty string", param)
        self._check_length(text, None, param)
        return self._require_tokenizer().encode_text(text).ids  # a control token's spelling stays text

    def _text_offsets(self, text: str, limit: int) -> tuple[list[int], list[tuple[int, int]]]:
        self._check_length(text, limit, "edit")
        enc = self._require_tokenizer().encode_text(text)  # GIL released; a control token's spelling stays text
        return enc.ids, enc.offsets

    def check_request(self, ids: list[int], params: SamplingParams, limits: Limits = Limits(),
                      mode: str = "diffusion", sampling: str = "fast") -> None:
        """Everything about a request that needs the model: the one validation path (SamplingParams)."""
        eos = params.eos_token_ids or ()
        params.check_decoding(mode, sampling, eos, self.tokenizer is not None)
        params.validate(self.module.cfg.text.vocab_size, self.max_context, len(ids), limits, self.cache_bytes)
        if params.stop and self.tokenizer is None:
            raise SamplingParamsError("stop strings need a tokenizer; this checkpoint has none", "stop")
        if params.grammar is not None:  # a matcher for this grammar: it must be able to match something
            self.grammar_vocab().matcher(params.grammar, eos)

    def grammar_vocab(self) -> GrammarVocab:
        """The vocabulary as the grammar engine sees it (built on first use)."""
        return shared_vocab(self, self._require_tokenizer().tok.to_str(), self.module.cfg.text.vocab_size,
                            self.defaults.eos_token_ids or ())

    # ---- generation -------------------------------------------------------------------------------------
    def generate(self, prompt: Prompt | list[Prompt], mode: str = "diffusion", sampling: str = "fast",
                 **options: Any) -> Result | list[Result]:
        """Generate for one prompt (returns a Result) or a list of prompts decoded as one batch. `mode`:
        diffusion, autoregressive or speculative (autoregressive output, drafted by the decoder); `sampling`
        (diffusion): fast, or reference (transformers draw for draw); `options`: SamplingParams fields, and for chat
        messages OpenAI's `tools`, `tool_choice` ("none", "auto" (the default with tools), "required",
        {"type": "function", "function": {"name": ...}}) and `parallel_tool_calls` (a reply of calls has
        Result.tool_calls; the chat template picks the call syntax)."""
        batch = isinstance(prompt, list) and bool(prompt) and all(isinstance(p, (str, list)) for p in prompt)
        prompts = prompt if batch else [prompt]
        results = {i: ev.result for i, ev in self._run(prompts, mode, sampling, options, False) if ev.kind == "done"}
        ordered = [results[i] for i in range(len(prompts))]
        return ordered if batch else ordered[0]

    def stream(self, prompt: Prompt, drafts: bool = True, mode: str = "diffusion", sampling: str = "fast",
               **options: Any) -> Iterator[StreamEvent]:
        """Yield drafts of the current canvas, committed text deltas, then a "done" event with the Result. With
        tools that may be called, the text is held back to the end (calls are read from the whole reply)."""
        yield from (event for _, event in self._run([prompt], mode, sampling, options, drafts))

    def runner(self, mode: str = "diffusion", sampling: str = "fast", max_batch: int = 16,
               prefix_cache: PrefixCache | None = None):
        """The engine for a decoding mode: `Engine` (continuous batching), `ReferenceRunner`,
        `AutoregressiveEngine` or `SpeculativeEngine` (all but the reference reuse `prefix_cache` if given); all take
        `add_request` and yield the same events from `stream()`."""
        eos = self.defaults.eos_token_ids or ()
        if mode not in MODES or sampling not in SAMPLINGS:
            bad, name, names = (("mode", mode, MODES) if mode not in MODES else ("sampling", sampling, SAMPLINGS))
            raise SamplingParamsError(f"{bad}={name!r} must be one of {', '.join(names)}", bad)
        if mode in ("autoregressive", "speculative"):
            engine = AutoregressiveEngine if mode == "autoregressive" else SpeculativeEngine
            runner = engine(self.module, eos, max_batch, prefix_cache)
        elif sampling == "reference":
            runner = ReferenceRunner(self.module, eos, self.pad_id)
        else:
            runner = Engine(self.module, eos, self.pad_id, max_batch, prefix_cache)
        if self.tokenizer is not None:
            runner.grammar_vocab = self.grammar_vocab
        return runner

    def _run(self, prompts: list[Prompt], mode: str, sampling: str, options: dict[str, Any],
             drafts: bool) -> Iterator[tuple[int, StreamEvent]]:
        chat = [options.pop(k, None) for k in ("tools", "tool_choice", "parallel_tool_calls")]
        tools = ToolUse.of(*chat, options.get("grammar"), options.get("logprobs") is not None, self.tokenizer,
                           "grammar")
        if tools.mode != "none" and not all(_is_chat(p) for p in prompts):
            raise SamplingParamsError("tools need a prompt of chat messages", "tools")
        params = self.params(**(options | ({"grammar": tools.grammar()} if tools.mode != "none" else {})))
        ids = [self.encode_prompt(p, tools=tools) for p in prompts]
        for x in ids:
            self.check_request(x, params, mode=mode, sampling=sampling)
        runner = self.runner(mode, sampling, max(1, len(ids)), self.prefix_cache)
        reqs = {}
        for i, x in enumerate(ids):
            req = runner.add_request(x, params, drafts=drafts)
            reqs[req.id] = (i, req, OutputStream(self.tokenizer, params.stop, tools))
        for ev in runner.stream():
            i, req, out = reqs[ev.request_id]
            for item in out.feed(ev):
                if item.kind == "done":
                    runner.abort(req.id)  # a stop string ends the request before the engine knows
                    req.stats.t_end = req.stats.t_end or time.perf_counter()
                    item.result = out.result(len(req.prompt), params.logprobs is not None, req.stats)
                yield i, item

    # ---- description ------------------------------------------------------------------------------------
    def describe(self) -> dict[str, Any]:
        cfg = self.module.cfg
        t = cfg.text
        return {
            "path": str(self.directory), "dtype": str(self.module.dtype).removeprefix("torch."),
            "device": str(self.module.device),
            "parameters": sum(p.numel() for p in self.module.parameters()) + sum(
                m.numel() for m in self.module.modules() if isinstance(m, QuantizedWeight)),
            "quantization": quant_summary(self.module), "kernels": kernel_summary(self.module),
            "layers": t.num_hidden_layers, "hidden_size": t.hidden_size, "vocab_size": t.vocab_size,
            "experts": f"{t.top_k_experts} of {t.num_experts}", "canvas_length": cfg.canvas_length,
            "sliding_window": t.sliding_window, "max_context": t.max_position_embeddings,
            "tokenizer": self.tokenizer is not None, "eos_token_ids": list(self.defaults.eos_token_ids or ()),
        }


def _is_chat(prompt: Any) -> bool:
    return isinstance(prompt, Sequence) and bool(prompt) and all(isinstance(m, dict) for m in prompt)


def _chars(value: Any) -> int:
    """Characters in every string of a text or of nested chat messages (keys excluded)."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, dict) and value.get("type") in ("image", "image_url"):
        return 0  # an image's length is its soft tokens, counted once they are known
    if isinstance(value, dict):
        return sum(_chars(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(_chars(v) for v in value)
    return 0
