"""Grammar-constrained denoising: request grammars (any JSON object, a JSON schema, a regex, a Lark grammar),
compiled and checked with llguidance, and the valid-prefix rule on a denoising step.

The rule (per constrained row of a canvas): the canvas holds a *locked* prefix that the grammar has consumed.
Each step, the frontier position (the first unlocked one) is drawn from grammar-masked logits (its sample is
kept when the grammar allows it: rejection sampling, so the draw is exactly the masked distribution), then the
run of entropy-accepted samples after it is locked as far as the grammar allows. Everything after the locked
prefix is rejected and renoised, so only a grammar-valid prefix is ever accepted. When the row's canvas ends
(stable and confident, or out of steps), the rest is completed greedily: the draft's token where the grammar
allows it, else the masked argmax. Whatever the model does, the committed text is a prefix of a sentence of the
grammar, ended by EOS only where the grammar is complete.
"""

from __future__ import annotations

import dataclasses
import json
import re
import threading
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import llguidance
import numpy as np
import torch
from torch import Tensor

from dgemma.errors import SamplingParamsError
from dgemma.sampling.budget import Completions

KINDS = ("json_object", "json_schema", "regex", "lark")
# compact JSON: no free whitespace, so a model cannot stall in an endless run of spaces
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}


@dataclass(frozen=True)
class Grammar:
    """What a constrained request's output must match. `source`: the schema as JSON text, the regex, or the
    Lark grammar (llguidance's dialect); `param` names the request field it came from, for errors. `thought`: the
    (open, close) ids of a thought channel the output may begin with, whose text is free, and the most tokens it may
    hold (None: any) (`after_thought`)."""

    kind: str
    source: str = ""
    param: str = "grammar"
    thought: tuple[int, int, int | None] | None = None

    @classmethod
    def json_object(cls, param: str = "grammar") -> Grammar:
        return cls("json_object", "", param)

    @classmethod
    def json_schema(cls, schema: dict[str, Any] | bool | str, param: str = "grammar") -> Grammar:
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise SamplingParamsError(f"the JSON schema is not valid JSON ({e})", param) from None
        if not isinstance(schema, (dict, bool)):
            raise SamplingParamsError("a JSON schema is a JSON object (or true / false)", param)
        return cls("json_schema", json.dumps(schema), param)

    @classmethod
    def regex(cls, pattern: str, param: str = "grammar") -> Grammar:
        return cls("regex", pattern, param)

    @classmethod
    def lark(cls, text: str, param: str = "grammar") -> Grammar:
        return cls("lark", text, param)

    def after_thought(self, open: int, close: int, max_tokens: int | None = None) -> Grammar:
        """This grammar for the answer after an optional thought channel: open id, any text (at most `max_tokens`
        tokens of it), close id."""
        return dataclasses.replace(self, thought=(open, close, max_tokens))

    def check(self) -> None:
        """Raises SamplingParamsError (naming `param`) when the grammar does not compile."""
        if self.kind not in KINDS:
            raise SamplingParamsError(f"grammar kind {self.kind!r} must be one of {', '.join(KINDS)}", self.param)
        if not isinstance(self.source, str) or (self.kind in ("regex", "lark") and not self.source):
            raise SamplingParamsError(f"the {self.kind} is empty", self.param)
        compiled(self)

    def describe(self) -> str:
        return {"json_object": "a JSON object", "json_schema": "the JSON schema", "regex": "the regex",
                "lark": "the grammar"}[self.kind]

    def invalid(self, reason: str) -> SamplingParamsError:
        """The one error of a grammar llguidance refuses (compiling it, or building a matcher)."""
        return SamplingParamsError(f"{self.describe()} is invalid or not supported: {reason}", self.param)


def compiled(g: Grammar) -> str:
    """llguidance's grammar text for `g`; raises SamplingParamsError with llguidance's reason."""
    text, error = _compile(g.kind, g.source, g.thought)
    if error:
        raise g.invalid(error)
    return text


@lru_cache(maxsize=256)
def _compile(kind: str, source: str, thought: tuple[int, int, int | None] | None) -> tuple[str, str]:
    try:
        if kind in ("json_object", "json_schema"):
            schema = {"type": "object"} if kind == "json_object" else json.loads(source)
            text = llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=JSON_OPTIONS)
        elif kind == "regex":
            text = llguidance.LLMatcher.grammar_from_regex(source)
        else:
            text = llguidance.LLMatcher.grammar_from_lark(source)
    except (ValueError, TypeError) as e:
        return "", _first_line(str(e))
    text = text if thought is None else _after_thought(text, *thought)
    return text, _first_line(llguidance.LLMatcher.validate_grammar(text))


def _after_thought(text: str, open: int, close: int, max_tokens: int | None) -> str:
    """llguidance's grammar `text` (a top-level JSON grammar or Lark text) as the sub-grammar after an optional
    thought: the channel's open token, any text (special tokens are not text: no close inside) of at most
    `max_tokens` tokens, its close token."""
    try:
        top = json.loads(text)
    except json.JSONDecodeError:
        top = {"grammars": [{"lark_grammar": text}]}
    inner = top["grammars"]
    inner[0] = inner[0] | {"name": "answer"}
    body = "" if max_tokens == 0 else "body "
    limit = "" if max_tokens is None else f"[max_tokens={max_tokens}]"
    outer = (f"start: thought? @answer\nthought: <[{open}]> {body}<[{close}]>\nbody{limit}: THOUGHT?\n"
             "THOUGHT: /[\\s\\S]+/\n")
    return json.dumps(top | {"grammars": [{"name": "after_thought", "lark_grammar": outer}, *inner]})


def _first_line(message: str) -> str:
    """llguidance's message on one line, without its echo of the grammar and the caret markers."""
    lines = [x.strip() for x in message.splitlines()]
    kept = [x for x in lines if x and not re.fullmatch(r"[\^\s]+|\d+ \|.*", x)]
    line = re.sub(r"^at \d+\(\d+\): ", "", " ".join(kept))
    return line if len(line) <= 300 else line[:297] + "..."


class GrammarVocab:
    """A checkpoint's vocabulary as llguidance sees it (built once per model: about a second for 262K tokens)."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_ids: tuple[int, ...]):
        self.vocab_size = vocab_size
        self.tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=list(eos_ids) or None)
        self.own_eos = tuple(self.tokenizer.eos_tokens)
        self.completions = Completions(self.tokenizer, vocab_size, set(self.own_eos))

    def matcher(self, g: Grammar, eos: tuple[int, ...]) -> RowGrammar:
        """A fresh matcher for one request; raises SamplingParamsError when `g` cannot match anything."""
        m = llguidance.LLMatcher(self.tokenizer, compiled(g), log_level=0)
        if m.is_error():
            raise g.invalid(_first_line(m.get_error()))
        row = RowGrammar(m, self, eos, g.thought[1] if g.thought is not None else None)
        if not row.allowed().any():
            raise SamplingParamsError(f"{g.describe()} cannot match any text", g.param)
        return row


_lock = threading.Lock()


def shared_vocab(owner: Any, tokenizer_json: str, vocab_size: int, eos_ids: tuple[int, ...]) -> GrammarVocab:
    """The GrammarVocab stored on `owner` (a loaded model), built on first use by whichever thread asks first."""
    with _lock:
        if getattr(owner, "_grammar_vocab", None) is None:
            owner._grammar_vocab = GrammarVocab(tokenizer_json, vocab_size, eos_ids)
        return owner._grammar_vocab


class RowGrammar:
    """One request's grammar state: the matcher has consumed every committed token and this canvas's locked
    prefix `locked` (at most `limit` tokens: the canvas, or the request's remaining budget).

    The budget rule: `witness` is a valid completion from the matcher's state (found by `Completions.shortest`)
    that fits the tokens left (`budget` at the canvas start, less the locked ones, one kept for the EOS). A token
    is locked only if a completion still fits after it, and `give_up` locks the witness's next token, so a row
    whose smallest answer fits its budget always ends complete. None: no completion fits (or none was found):
    the rule is off and the answer may be cut ("length")."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab: GrammarVocab, eos: tuple[int, ...],
                 exit: int | None = None):
        self.matcher, self.vocab, self.eos = matcher, vocab, tuple(eos)
        self.exit = exit  # the thought channel's close, which completions take first (Completions.shortest)
        self.stops = set(self.eos) | set(vocab.own_eos)
        self.locked: list[int] = []
        self.limit = 0
        self.budget: int | None = None  # tokens this request may still write, at the canvas start
        self.witness: list[int] | None = None
        self.ended = False  # an EOS is locked: the grammar is complete
        self.written = False  # this canvas's prefix is final and written into the draft

    def start_canvas(self, limit: int, budget: int | None = None) -> None:
        """A fresh prefix of at most `limit` tokens; `budget`: tokens the request may still write (EOS
        included), default `limit`. The first call searches the witness."""
        first = self.budget is None
        self.locked, self.limit, self.written = [], limit, False
        self.budget = limit if budget is None else budget
        if first:
            self.witness = self.vocab.completions.shortest(self.matcher, self.budget - 1, exit=self.exit)

    def give_up(self) -> None:
        """Lock the token the budget reserves: the witness's next one, or an EOS where the grammar is complete.
        Without a witness, end the row (where the grammar allows no token at all: cannot happen with a
        consistent grammar and tokenizer; kept so that a broken one ends a request instead of hanging it)."""
        if self.witness:
            self.matcher.consume_token(self.witness[0])
            self.locked.append(self.witness.pop(0))
            return
        self.locked.append(self.eos[0])
        self.ended = True

    @property
    def complete(self) -> bool:
        """Nothing left to decide on this canvas."""
        return self.ended or len(self.locked) >= self.limit

    def extend(self, tokens: list[int]) -> int:
        """Lock the longest prefix of `tokens` the grammar and the budget allow (an EOS only where the grammar is
        complete); returns how many were locked."""
        tokens = tokens[:self.limit - len(self.locked)]
        k = next((i for i, t in enumerate(tokens) if t in self.stops), len(tokens))
        n = 0
        while n < k and self.matcher.try_consume_tokens([tokens[n]]) and self._fits(tokens[n]):
            self.locked.append(tokens[n])
            n += 1
        if n == k < len(tokens) and tokens[k] in self.eos and self.matcher.is_accepting():
            self.locked.append(tokens[k])
            self.ended, n = True, n + 1
        return n

    def _fits(self, token: int) -> bool:
        """After consuming `token`: whether a completion still fits what is left (else `token` is rolled back)."""
        w = self.witness
        if w is None:
            return True
        room = self.budget - len(self.locked) - 2  # tokens left after this one, less the EOS
        if w and w[0] == token:
            self.witness = w[1:]
            return True
        completions = self.vocab.completions
        if len(w) <= room and completions.still_completes(self.matcher, w):
            return True
        # any completion that fits keeps the promise: the plain greedy one first, the planned search when it does not
        found = (completions.shortest(self.matcher, room, plan=False, exit=self.exit) or
                 completions.shortest(self.matcher, room, exit=self.exit) if room >= 0 else None)
        if found is None:
            self.matcher.rollback(1)
            return False
        self.witness = found
        return True

    def allowed(self) -> Tensor:
        """bool [V] on the CPU: the tokens the grammar allows next (the request's EOS ids where it is complete)."""
        bits = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8)
        mask = np.unpackbits(bits, bitorder="little")[:self.vocab.vocab_size].astype(bool)
        mask[list(self.vocab.own_eos)] = False
        mask[list(self.eos)] = self.matcher.is_accepting()
        return torch.from_numpy(mask)
