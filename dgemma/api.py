"""Python API: `dgemma.load(...)` returns a `Model` whose `generate` / `stream` take text, chat messages or ids."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from dgemma.engine import Engine, Event, Request
from dgemma.engine import autoregressive
from dgemma.errors import DgemmaError
from dgemma.dtypes import native_bf16, parse_dtype
from dgemma.sampling import SamplingParams, make_generator
from dgemma.textstream import TextStream
from dgemma.tokenizer import Tokenizer, read_json
from dgemma.weights import load_model, resolve_checkpoint

DEMO_MODEL = Path(__file__).parent / "assets" / "demo"

Prompt = str | list[int] | list[dict[str, Any]]


@dataclass
class Result:
    token_ids: list[int]
    text: str | None
    finish_reason: str
    stats: dict[str, Any] = field(default_factory=dict)
    prompt_tokens: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {"token_ids": self.token_ids, "text": self.text, "finish_reason": self.finish_reason,
                "prompt_tokens": self.prompt_tokens, "stats": self.stats}


@dataclass
class StreamEvent:
    """kind: "draft" (text of the current canvas), "text" (newly committed text), "done" (the final Result)."""

    kind: str
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    result: Result | None = None


def load(path_or_repo: str | Path | None = None, dtype: str | torch.dtype = "auto",
         device: str | torch.device = "cpu") -> Model:
    """Load a checkpoint directory or cached Hugging Face repo id (default: the bundled demo model)."""
    if path_or_repo is None:
        if not (DEMO_MODEL / "config.json").is_file():
            raise DgemmaError("the bundled demo model is missing from this install; pass --model PATH")
        path_or_repo = DEMO_MODEL
    directory = resolve_checkpoint(path_or_repo)
    try:
        device = torch.device(device)
        torch.empty(0, device=device)
    except (RuntimeError, AssertionError) as e:
        raise DgemmaError(f"device {device!s} is not available ({e})") from None
    torch_dtype = _resolve_dtype(dtype, directory, device)
    return Model(load_model(directory, torch_dtype, device), Tokenizer.maybe_load(directory), directory)


AUTO_FLOAT32_BYTES = 4 << 30  # "auto" upcasts bf16 checkpoints up to this size where bf16 is slow


def _resolve_dtype(dtype: str | torch.dtype, directory: Path, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        try:
            config = json.loads((directory / "config.json").read_text())
        except (OSError, json.JSONDecodeError, UnicodeDecodeError):
            config = {}  # load_model reports a missing or broken config.json
        saved = config.get("dtype") or config.get("torch_dtype") if isinstance(config, dict) else None
        if saved != "bfloat16":
            return torch.float32
        small = sum(f.stat().st_size for f in directory.glob("*.safetensors")) <= AUTO_FLOAT32_BYTES
        return torch.float32 if small and not native_bf16(device.type) else torch.bfloat16
    return parse_dtype(dtype)


class Model:
    def __init__(self, model, tokenizer: Tokenizer | None, directory: Path):
        self.model = model
        self.tokenizer = tokenizer
        self.directory = directory
        text = model.cfg.text
        self.defaults = SamplingParams.from_generation_config(read_json(directory / "generation_config.json"))
        if self.defaults.eos_token_ids is None:
            self.defaults = self.defaults.replace(eos_token_ids=text.eos_token_id)
        self.pad_id = text.pad_token_id
        self.max_context = text.max_position_embeddings

    # ---- inputs -----------------------------------------------------------------------------------------
    def encode_prompt(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise DgemmaError("empty prompt")
            ids = self._require_tokenizer().encode(prompt)
        elif isinstance(prompt, Sequence) and prompt and all(isinstance(m, dict) for m in prompt):
            ids = self._require_tokenizer().encode_chat(list(prompt))
        elif isinstance(prompt, Sequence) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            ids = list(prompt)
        else:
            raise DgemmaError("a prompt is text, a list of chat messages, or a list of token ids")
        return self.check_ids(ids)

    def check_ids(self, ids: list[int]) -> list[int]:
        vocab = self.model.cfg.text.vocab_size
        if not ids:
            raise DgemmaError("empty prompt")
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise DgemmaError(f"token id {bad[0]} is outside the vocabulary (0..{vocab - 1})")
        if self.model.cfg.image_token_id in ids:
            raise DgemmaError("image inputs are not supported yet (the prompt contains the image token)")
        return ids

    def _require_tokenizer(self) -> Tokenizer:
        if self.tokenizer is None:
            raise DgemmaError("this checkpoint has no tokenizer.json; pass token ids instead of text")
        return self.tokenizer

    def params(self, **options: Any) -> SamplingParams:
        return self.defaults.replace(**options)

    def check_request(self, ids: list[int], params: SamplingParams) -> None:
        params.validate(self.model.cfg.text.vocab_size, self.max_context, len(ids))
        if params.stop and self.tokenizer is None:
            raise DgemmaError("stop strings need a tokenizer; this checkpoint has none")

    # ---- generation -------------------------------------------------------------------------------------
    def generate(self, prompt: Prompt | list[Prompt], **options: Any) -> Result | list[Result]:
        """Generate for one prompt (returns a Result) or a list of prompts decoded as one batch."""
        batch = isinstance(prompt, list) and bool(prompt) and all(isinstance(p, (str, list)) for p in prompt)
        prompts = prompt if batch else [prompt]
        results: dict[int, Result] = {}
        for i, event in self._run(prompts, options, drafts=False):
            if event.kind == "done":
                results[i] = event.result
        ordered = [results[i] for i in range(len(prompts))]
        return ordered if batch else ordered[0]

    def stream(self, prompt: Prompt, drafts: bool = True, **options: Any) -> Iterator[StreamEvent]:
        """Yield draft canvases (as text), committed text deltas, then a final "done" event with the Result."""
        yield from (event for _, event in self._run([prompt], options, drafts=drafts))

    def _run(self, prompts: list[Prompt], options: dict[str, Any], drafts: bool) -> Iterator[tuple[int, StreamEvent]]:
        params = self.params(**options)
        ids = [self.encode_prompt(p) for p in prompts]
        for x in ids:
            self.check_request(x, params)
        if params.mode == "autoregressive":
            for i, x in enumerate(ids):
                req = Request(f"ar-{i}", x, params, params.eos_token_ids, generator=make_generator(params.seed))
                yield from self._drive({req.id: (i, req)}, autoregressive.decode(self.model, req))
            return
        engine = Engine(self.model, params.eos_token_ids, self.pad_id, params.sampling, max_batch=max(1, len(ids)))
        if params.sampling == "reference" and params.seed is not None:
            torch.manual_seed(params.seed)
        reqs = {}
        for i, x in enumerate(ids):
            req = engine.add_request(x, params, drafts=drafts)
            reqs[req.id] = (i, req)
        yield from self._drive(reqs, engine.stream(), engine)

    def _drive(self, reqs: dict[str, tuple[int, Request]], events: Iterator[Event],
               engine: Engine | None = None) -> Iterator[tuple[int, StreamEvent]]:
        streams = {rid: TextStream(self.tokenizer, r.params.stop) if self.tokenizer else None
                   for rid, (_, r) in reqs.items()}
        for ev in events:
            i, req = reqs[ev.request_id]
            ts = streams[ev.request_id]
            if ev.kind == "draft":
                text = self.tokenizer.decode(ev.token_ids) if self.tokenizer else ""
                yield i, StreamEvent("draft", text, ev.token_ids)
            elif ev.kind == "commit":
                delta = ts.push(ev.token_ids) if ts else ""
                yield i, StreamEvent("text", delta, ev.token_ids)
                if ts and ts.stopped and not req.finished:
                    if engine is not None:
                        engine.abort(req.id)
                    req.finish_reason = "stop"
                    yield i, self._done(req, ts)
            elif ev.kind == "finish" and not (ts and ts.stopped):
                if ts:
                    tail = ts.push([], final=True)
                    if tail:
                        yield i, StreamEvent("text", tail)
                yield i, self._done(req, ts)

    def _done(self, req: Request, ts: TextStream | None) -> StreamEvent:
        req.stats.t_end = req.stats.t_end or time.perf_counter()
        ids = ts.kept_ids() if ts else req.output
        text = ts.text if ts else None
        reason = "stop" if ts and ts.stopped else req.finish_reason
        result = Result(ids, text, reason, req.stats.to_dict(len(ids)), len(req.prompt))
        return StreamEvent("done", result=result)

    # ---- description ------------------------------------------------------------------------------------
    def describe(self) -> dict[str, Any]:
        cfg = self.model.cfg
        t = cfg.text
        return {
            "path": str(self.directory), "dtype": str(self.model.dtype).removeprefix("torch."),
            "device": str(self.model.device),
            "parameters": sum(p.numel() for p in self.model.parameters()),
            "layers": t.num_hidden_layers, "hidden_size": t.hidden_size, "vocab_size": t.vocab_size,
            "experts": f"{t.top_k_experts} of {t.num_experts}", "canvas_length": cfg.canvas_length,
            "sliding_window": t.sliding_window, "max_context": t.max_position_embeddings,
            "tokenizer": self.tokenizer is not None, "eos_token_ids": list(self.defaults.eos_token_ids or ()),
        }
