"""Python API: `dgemma.load(...)` returns a `Model` whose `generate` / `stream` take text, chat messages (with
tools) or ids. `Model` holds a checkpoint's defaults and its request checks and composes the parts: opening the
checkpoint (checkpoint.py), prompts and layout canvases as ids (prompts.py), running them (running.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from dgemma import images, parallel
from dgemma.api import running
from dgemma.api.checkpoint import DEMO_MODEL, open_checkpoint
from dgemma.api.prompts import Prompt, PromptEncoder
from dgemma.cache import KVCache
from dgemma.chat.turn import ChatTurn
from dgemma.engine import PrefixCache, Result, StreamEvent
from dgemma.jsonfile import read_json
from dgemma.options import check_modes
from dgemma.quant import QuantizedWeight, kernel_summary
from dgemma.quant import summary as quant_summary
from dgemma.sampling import Limits, SamplingParams, SamplingParamsError
from dgemma.sampling.constraints import GrammarVocab, shared_vocab
from dgemma.sampling.temperature import is_greedy, temperature_fields
from dgemma.tokenizer import Tokenizer

__all__ = ["DEMO_MODEL", "Model", "Prompt", "load", "load_model_from_args"]
LAYOUT_OPTIONS = ("suffix", "template", "edit", "renoise")  # the layout options of `Model.params`


def load(path_or_repo: str | Path | None = None, dtype: str | torch.dtype = "auto",
         device: str | torch.device = "cpu", compile: bool = False, quantize: str | None = None,
         revision: str | None = None, tensor_parallel_size: int = 1) -> Model:
    """Load a checkpoint directory, a Hugging Face repo id (downloaded unless cached; `revision`: a branch, tag or
    commit) or a GGUF file of llama.cpp's diffusion-gemma architecture (default: the bundled demo model).
    `compile`: run the denoising pass (the per-step body) through torch.compile; off, nothing changes.
    `quantize`: "int8" | "int4" (see `dgemma.quant.spec` for group sizes and the embedding): weight-only
    quantization while loading, tensor by tensor with plain file reads (not the memory map). A GGUF file keeps
    its quantized tensors compact without it (see `dgemma.weights.gguf_load`); with it, they are re-quantized to
    that scheme.
    `tensor_parallel_size`: N > 1 in each of the N processes torchrun started: every rank keeps its shard of the
    model (`dgemma.parallel`) and must then make the same calls with the same arguments (seeds default to rank 0's)."""
    return Model(*open_checkpoint(path_or_repo, dtype, device, compile, quantize, revision, tensor_parallel_size))


def load_model_from_args(args) -> Model:
    """`load` with the options commands share (`options.add_model_options`)."""
    return load(args.model, dtype=args.dtype, device=args.device, compile=args.compile, quantize=args.quantize,
                revision=getattr(args, "revision", None),
                tensor_parallel_size=getattr(args, "tensor_parallel_size", None) or 1)


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
        self.speculative_pacing = "counted"  # or "timed" (opt-in, not bit-reproducible): SpeculativeEngine's pacing
        self.prompts = PromptEncoder(module, tokenizer, self.max_context)

    # ---- inputs -----------------------------------------------------------------------------------------
    def encode_prompt(self, prompt: Prompt, max_tokens: int | None = None,
                      tools: ChatTurn | list[dict[str, Any]] | None = None, partition: str | None = None) -> list[int]:
        """Text, chat messages (rendered with `tools`: OpenAI tool objects, or a chat.turn.ChatTurn with the template's
        arguments too) or ids -> ids.
        With `max_tokens`, a prompt that cannot fit in that many tokens (more characters than that many of the
        longest token hold, x CHAR_MARGIN) is refused before any tokenizing, so its cost is bounded by the limit,
        not by its length. `partition`: whose prompt this is (an API key, a cache salt): images are cached apart."""
        return self.prompts.encode(prompt, max_tokens, tools, partition, self.image_limits)

    def prompt_limit(self, limits: Limits = Limits()) -> int:
        """The most tokens a prompt may have: the context less one new token, and the deployment's cap."""
        return self.prompts.prompt_limit(limits)

    def check_ids(self, ids: list[int]) -> list[int]:
        return self.prompts.check_ids(ids)

    def token_bytes(self, token_id: int) -> bytes:
        """A token's raw bytes (a piece of a multi-byte character stays a piece)."""
        return self.grammar_vocab().tokenizer.decode_bytes([token_id])

    # ---- a request's parameters and checks -------------------------------------------------------------------
    def params(self, mode: str | None = None, sampling: str = "fast", **options: Any) -> SamplingParams:
        """SamplingParams fields, plus the layout options: `suffix` (infill: the output is the text
        between the prompt and this suffix, at most max_new_tokens), `template` (text with [[hole]] /
        [[hole:N]] holes; the output is the filled template), `edit` (a draft, text or ids) with `renoise`
        (a fraction of its tokens chosen by the seed, or (start, end) spans: characters of a text draft, indices
        of an id draft). `layout_limit`: the most tokens a template or edit may have (default: the context); a
        longer one is refused before it is tokenized or built. `temperature` T is OpenAI's field, as the server
        reads it: the schedule T -> T/2 in diffusion mode, ar_temperature T in the others (below 1e-3 without a
        seed: seed 0). With `mode` (and `sampling`), a field set for another decoding is refused
        (`options.check_modes`), not ignored."""
        if "temperature" in options:  # OpenAI's field, as the server maps it (sampling/temperature.py)
            temperature = options.pop("temperature")
            options |= temperature_fields(temperature, mode or "diffusion", options)
            if is_greedy(temperature) and options.get("seed") is None:
                options["seed"] = 0
        if mode is not None:
            check_modes([k for k, v in options.items() if v is not None], mode, sampling)
        if self.module.parallel is not None:  # every rank draws with rank 0's seed
            options["seed"] = self.module.parallel.shared_seed(options.get("seed"))
        layout_options = {k: options.pop(k) for k in LAYOUT_OPTIONS if k in options}
        limit = min(self.max_context, options.pop("layout_limit", None) or self.max_context)
        if any(v is not None for v in layout_options.values()):
            hole = options.get("max_new_tokens")
            hole = self.defaults.max_new_tokens if hole is None else hole
            options["layout"] = self.prompts.layout(limit, hole, options.get("seed"), **layout_options)
        return self.defaults.replace(**options)

    def check_request(self, ids: list[int], params: SamplingParams, limits: Limits = Limits(),
                      mode: str = "diffusion", sampling: str = "fast") -> None:
        """Everything about a request that needs the model: the one validation path (SamplingParams)."""
        eos = params.eos_token_ids or ()
        params.check_decoding(mode, sampling, eos, self.tokenizer is not None)
        if self.module.parallel is not None:
            parallel.check_request(params, mode, self.speculative_pacing)
        params.validate(self.module.cfg.text.vocab_size, self.max_context, len(ids), limits, self.cache_bytes)
        if params.stop and self.tokenizer is None:
            raise SamplingParamsError("stop strings need a tokenizer; this checkpoint has none", "stop")
        if params.grammar is not None:  # a matcher for this grammar: it must be able to match something
            self.grammar_vocab().matcher(params.grammar, eos)

    def cache_bytes(self, tokens: int) -> int:
        """KV-cache bytes a request with this many prompt + new tokens needs (one canvas more while denoising)."""
        m = self.module
        return KVCache.bytes_for(m.cfg.text, tokens + m.cfg.canvas_length, m.dtype, m.cfg.canvas_length)

    def grammar_vocab(self) -> GrammarVocab:
        """The vocabulary as the grammar engine sees it (built on first use)."""
        return shared_vocab(self, self.prompts.require_tokenizer().tok.to_str(), self.module.cfg.text.vocab_size,
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
        return running.results(self, prompt, mode, sampling, options)

    def stream(self, prompt: Prompt, drafts: bool = True, mode: str = "diffusion", sampling: str = "fast",
               **options: Any) -> Iterator[StreamEvent]:
        """Yield drafts of the current canvas, committed text deltas, then a "done" event with the Result. With
        tools that may be called, the text is held back to the end (calls are read from the whole reply)."""
        yield from (event for _, event in running.run(self, [prompt], mode, sampling, options, drafts))

    def runner(self, mode: str = "diffusion", sampling: str = "fast", max_batch: int = 16,
               prefix_cache: PrefixCache | None = None):
        """The engine for a decoding mode: `Engine` (continuous batching), `ReferenceEngine`,
        `AutoregressiveEngine` or `SpeculativeEngine` (all but the reference reuse `prefix_cache` if given); all take
        `add_request` and yield the same events from `stream()`."""
        return running.engine_for(self, mode, sampling, max_batch, prefix_cache)

    # ---- description ------------------------------------------------------------------------------------
    def describe(self) -> dict[str, Any]:
        """What `dgemma info` prints: the checkpoint's shape, dtype, quantization, tokenizer and vision tower."""
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
            "vision_tower": _vision(self.module),
        }


def _vision(module) -> str | None:
    """The vision tower in a word: None without one (the checkpoint takes text only)."""
    if module.vision is None:
        return None
    params = sum(p.numel() for p in module.vision.parameters())
    return f"{params:,} parameters in {module.cfg.vision.num_hidden_layers} layer(s)"
