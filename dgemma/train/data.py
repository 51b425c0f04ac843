"""Training data: plain text and chat JSONL turned into (prompt, response) examples, and right-padded batches.

An example's response is cut into canvases of `canvas_length` tokens; the rest of the last canvas is filled with
EOS (scored by the decoder). Plain text: each document becomes `<bos>` + tokens + `<eos>`, whose tokens are cut
into windows of `canvases` canvases; a window's prompt is `<bos>` plus a random-length stretch of the text just
before it, so every token is in exactly one canvas per epoch and canvases start after prompts of many lengths.
Chat: the prompt is the rendered conversation up to the last assistant turn, the response is that turn
(+ `<end_of_turn>`); long answers span several canvases.
"""

from __future__ import annotations

import dataclasses
import json
import random
from dataclasses import dataclass
from pathlib import Path

import torch

from dgemma.errors import DgemmaError

DOCUMENT_SEPARATOR = "\n\n\n"


@dataclass(frozen=True)
class Example:
    prompt: list[int]  # context, starts with <bos>; never decoded
    response: list[int]  # cut into canvases
    ar_prompt: bool = True  # the encoder's next-token loss also covers the prompt (text) or not (chat)


@dataclass
class TrainBatch:
    """Right-padded clean sequences: row b is prompt_len[b] tokens, then n_canvases[b] canvases, then padding."""

    ids: torch.Tensor  # [B, L] long, pad 0
    valid: torch.Tensor  # [B, L] bool
    ar_mask: torch.Tensor  # [B, L] bool: position i's next token ids[i + 1] is scored by the encoder loss
    prompt_len: torch.Tensor  # [B] long
    n_canvases: torch.Tensor  # [B] long

    @property
    def tokens(self) -> int:
        return int(self.valid.sum())


def rows_of_rank(batch: int, rank: int, world: int) -> slice:
    """Rank `rank` of `world` takes this contiguous stretch of a global batch's rows (sizes differ by at most one)."""
    return slice(rank * batch // world, (rank + 1) * batch // world)


def take_rows(rows, index: slice):
    """A dataclass of tensors with a leading batch dimension (TrainBatch, objective.Noise), cut to `index`."""
    return type(rows)(*(getattr(rows, f.name)[index] for f in dataclasses.fields(rows)))


def canvases_of(response: list[int], canvas_length: int, eos: int) -> list[int]:
    """The response padded with EOS to a whole number of canvases (at least one)."""
    n = max(1, -(-len(response) // canvas_length))
    return response + [eos] * (n * canvas_length - len(response))


def collate(examples: list[Example], canvas_length: int, eos: int, pad: int = 0) -> TrainBatch:
    rows = [ex.prompt + canvases_of(ex.response, canvas_length, eos) for ex in examples]
    length = max(len(r) for r in rows)
    b = len(rows)
    ids = torch.full((b, length), pad, dtype=torch.long)
    valid = torch.zeros(b, length, dtype=torch.bool)
    ar_mask = torch.zeros(b, length, dtype=torch.bool)
    for i, (ex, row) in enumerate(zip(examples, rows)):
        ids[i, :len(row)] = torch.tensor(row)
        valid[i, :len(row)] = True
        # target j = i + 1 is scored for j in [first, end): the real tokens, plus the first EOS of the fill
        # unless the response already ends with one; the rest of the fill is not an AR target
        first = 1 if ex.ar_prompt else len(ex.prompt)
        end = len(ex.prompt) + len(ex.response)
        last = end + (1 if len(row) > end and ex.response[-1:] != [eos] else 0)
        ar_mask[i, first - 1:last - 1] = True
    prompt_len = torch.tensor([len(ex.prompt) for ex in examples])
    n_canvases = torch.tensor([(len(r) - len(ex.prompt)) // canvas_length for ex, r in zip(examples, rows)])
    return TrainBatch(ids, valid, ar_mask, prompt_len, n_canvases)


class TextWindows:
    """Documents of token ids cut into windows of `canvases * canvas_length` response tokens."""

    def __init__(self, docs: list[list[int]], canvas_length: int, canvases: int, max_prompt: int, bos: int,
                 eos: int, seed: int):
        self.docs = [d + [eos] for d in docs if d]
        self.span = canvas_length * canvases
        self.max_prompt, self.bos, self.seed = max_prompt, bos, seed
        self.index = [(d, start) for d, doc in enumerate(self.docs) for start in range(0, len(doc), self.span)]

    def __len__(self) -> int:
        return len(self.index)

    def get(self, i: int, epoch: int) -> Example:
        d, start = self.index[i]
        doc = self.docs[d]
        # a fresh prompt length per (epoch, window); str seeds are hashed the same in every process
        context = random.Random(f"{self.seed}/{epoch}/{i}").randint(0, self.max_prompt - 1)
        prompt = [self.bos] + doc[max(0, start - context):start]
        return Example(prompt, doc[start:start + self.span], ar_prompt=True)


class ChatExamples:
    def __init__(self, examples: list[Example]):
        self.examples = examples

    def __len__(self) -> int:
        return len(self.examples)

    def get(self, i: int, epoch: int) -> Example:
        return self.examples[i]


def read_text_documents(path: Path) -> list[str]:
    text = _read(path)
    return [d.strip("\n") for d in text.split(DOCUMENT_SEPARATOR) if d.strip()]


def tokenize_documents(tokenizer, docs: list[str]) -> list[list[int]]:
    return [e.ids for e in tokenizer.tok.encode_batch(docs, add_special_tokens=False)]


def chat_example(tokenizer, messages: list[dict], max_prompt: int, max_response: int, where: str) -> Example:
    """Loss on the last assistant turn: prompt = the conversation before it, rendered by the chat template."""
    if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
        raise DgemmaError(f"{where}: 'messages' must be a non-empty list of objects")
    if messages[-1].get("role") != "assistant" or not isinstance(messages[-1].get("content"), str):
        raise DgemmaError(f"{where}: the last message must be an assistant turn with string content")
    prompt = tokenizer.encode(tokenizer.apply_chat_template(messages[:-1], add_generation_prompt=True),
                              add_bos=False)
    end = tokenizer.token_id("<end_of_turn>")
    response = tokenizer.encode(messages[-1]["content"].strip(), add_bos=False)
    response = response + ([end] if end is not None else [])
    if len(prompt) > max_prompt:  # keep <bos> and the most recent context
        prompt = prompt[:1] + prompt[len(prompt) - max_prompt + 1:]
    return Example(prompt, response[:max_response], ar_prompt=False)


def read_chat(path: Path, tokenizer, max_prompt: int, max_response: int) -> list[Example]:
    out = []
    for n, line in enumerate(_read(path).splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path}:{n}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise DgemmaError(f"{where}: invalid JSON ({e.msg})") from None
        if not isinstance(record, dict) or "messages" not in record:
            raise DgemmaError(f"{where}: expected an object with 'messages'")
        out.append(chat_example(tokenizer, record["messages"], max_prompt, max_response, where))
    if not out:
        raise DgemmaError(f"{path}: no examples")
    return out


def _read(path: Path) -> str:
    try:
        return Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise DgemmaError(f"data file not found: {path}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise DgemmaError(f"cannot read {path}: {e}") from None


def load_dataset(path: str | Path, tokenizer, canvas_length: int, canvases: int, max_prompt: int, seed: int):
    """`.jsonl` files are chat data, anything else plain text (documents separated by two blank lines)."""
    path = Path(path)
    eos, bos = _special(tokenizer, "eos"), _special(tokenizer, "bos")
    if path.suffix == ".jsonl":
        return ChatExamples(read_chat(path, tokenizer, max_prompt, canvases * canvas_length))
    docs = tokenize_documents(tokenizer, read_text_documents(path))
    windows = TextWindows(docs, canvas_length, canvases, max_prompt, bos, eos, seed)
    if not len(windows):
        raise DgemmaError(f"{path}: no text")
    return windows


def _special(tokenizer, kind: str) -> int:
    text = tokenizer.eos_token if kind == "eos" else tokenizer.bos_token
    token = tokenizer.token_id(text)
    if token is None:
        raise DgemmaError(f"the tokenizer has no {kind} token {text!r}")
    return token


class Loader:
    """Shuffled batches with a resumable position: (epoch, cursor) into a per-epoch permutation."""

    def __init__(self, dataset, batch_size: int, canvas_length: int, eos: int, seed: int):
        self.dataset, self.batch_size, self.canvas_length, self.eos = dataset, batch_size, canvas_length, eos
        self.seed = seed
        self.epoch, self.cursor = 0, 0
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> list[int]:
        g = torch.Generator().manual_seed(self.seed * 100_003 + epoch)
        return torch.randperm(len(self.dataset), generator=g).tolist()

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "cursor": self.cursor}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.cursor = state["epoch"], state["cursor"]
        self._order = self._permutation(self.epoch)

    def next(self) -> TrainBatch:
        examples = []
        while len(examples) < self.batch_size:
            if self.cursor >= len(self._order):
                self.epoch, self.cursor = self.epoch + 1, 0
                self._order = self._permutation(self.epoch)
            examples.append(self.dataset.get(self._order[self.cursor], self.epoch))
            self.cursor += 1
        return collate(examples, self.canvas_length, self.eos)
