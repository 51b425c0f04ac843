#!/usr/bin/env python3
"""Train a byte-level BPE tokenizer with Gemma-style special tokens on the demo corpus.

Special tokens sit at the ids the dgemma model config expects: 0 ``<pad>``, 1 ``<eos>``,
2 ``<bos>``, 3 ``<unk>``, 4 ``<start_of_turn>``, 5 ``<end_of_turn>``. As with Gemma,
encoding prepends ``<bos>`` and the chat template starts with the bos token (render it
with ``add_special_tokens=False``). Byte-level pre-tokenization covers every byte, so
any UTF-8 text round-trips through encode and decode; the script checks that before
writing anything.

Writes ``tokenizer.json``, ``tokenizer_config.json`` (with a Gemma-like
``chat_template``) and ``special_tokens_map.json`` to ``--out``, then prints the number
of tokens in the training corpus and the average characters per token.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path
from typing import Any, NoReturn

import jinja2
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

PAD, EOS, BOS, UNK = "<pad>", "<eos>", "<bos>", "<unk>"
START_OF_TURN, END_OF_TURN = "<start_of_turn>", "<end_of_turn>"
SPECIAL_TOKENS = [PAD, EOS, BOS, UNK, START_OF_TURN, END_OF_TURN]  # list index == token id
DOCUMENT_SEPARATOR = "\n\n\n"  # see scripts/build_corpus.py

CHAT_TEMPLATE = (
    "{{- bos_token -}}\n"
    "{%- if messages and messages[0]['role'] == 'system' -%}\n"
    "  {%- set first_user_prefix = messages[0]['content'] | trim + '\\n\\n' -%}\n"
    "  {%- set loop_messages = messages[1:] -%}\n"
    "{%- else -%}\n"
    "  {%- set first_user_prefix = '' -%}\n"
    "  {%- set loop_messages = messages -%}\n"
    "{%- endif -%}\n"
    "{%- for message in loop_messages -%}\n"
    "  {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}\n"
    "    {{- raise_exception('Conversation roles must alternate user/model/user/model/...') -}}\n"
    "  {%- endif -%}\n"
    "  {%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}\n"
    "  {{- '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else '') -}}\n"
    "  {{- message['content'] | trim + '<end_of_turn>\\n' -}}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}\n"
    "  {{- '<start_of_turn>model\\n' -}}\n"
    "{%- endif -%}\n"
)


def fail(message: str) -> NoReturn:
    """Print a one-line error and exit with status 1."""
    print(f"train_tokenizer: error: {message}", file=sys.stderr)
    sys.exit(1)


def build_tokenizer() -> Tokenizer:
    """An untrained byte-level BPE pipeline that prepends ``<bos>`` like Gemma."""
    tokenizer = Tokenizer(models.BPE(unk_token=UNK))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B",
        special_tokens=[(BOS, SPECIAL_TOKENS.index(BOS))])
    return tokenizer


def train(tokenizer: Tokenizer, corpus: Path, vocab_size: int, min_frequency: int) -> None:
    """Learn the BPE merges; the trainer shows its own progress bar."""
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=True)
    tokenizer.train([str(corpus)], trainer)
    for token_id, token in enumerate(SPECIAL_TOKENS):
        if tokenizer.token_to_id(token) != token_id:
            fail(f"special token {token} got id {tokenizer.token_to_id(token)}, expected {token_id}")


def roundtrip_samples(seed: int = 0, count: int = 200) -> list[str]:
    """Fixed tricky strings plus random strings of arbitrary Unicode scalar values."""
    rng = random.Random(seed)
    fixed = ["", " ", "\n\n\n", "  leading and trailing  ", "tab\there\r\nCRLF",
             "naïve café — “quotes” ½ £5", "日本語のテキスト", "emoji 👩‍👩‍👧 🇬🇧",
             "e\u0301 combining", "\x00\x01\x7f control", "<bos> literal <eos> <start_of_turn>",
             "Ã©", "\ufeffBOM", "\U0010ffff max code point"]
    scalars = [c for c in range(0x110000) if not 0xD800 <= c <= 0xDFFF]
    randoms = ["".join(chr(rng.choice(scalars)) for _ in range(rng.randint(1, 40)))
               for _ in range(count)]
    return fixed + randoms


def check_roundtrip(tokenizer: Tokenizer) -> int:
    """Assert decode(encode(text)) == text for every sample; return the sample count."""
    samples = roundtrip_samples()
    for text in samples:
        ids = tokenizer.encode(text, add_special_tokens=False).ids
        decoded = tokenizer.decode(ids, skip_special_tokens=False)
        if decoded != text:
            fail(f"byte-level round trip failed for {text!r}: got {decoded!r}")
        if UNK in tokenizer.encode(text).tokens:
            fail(f"{text!r} produced {UNK}")
    return len(samples)


def render_chat(messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
    """Render CHAT_TEMPLATE the way transformers does (jinja2, trim_blocks, lstrip_blocks)."""
    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    return env.from_string(CHAT_TEMPLATE).render(
        messages=messages, bos_token=BOS, eos_token=EOS, add_generation_prompt=add_generation_prompt)


def check_chat_template(tokenizer: Tokenizer) -> None:
    """The template must produce Gemma's turn layout and encode turn markers as single ids."""
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Who?"}]
    expected = ("<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n"
                "<start_of_turn>model\nHello.<end_of_turn>\n"
                "<start_of_turn>user\nWho?<end_of_turn>\n<start_of_turn>model\n")
    rendered = render_chat(messages, add_generation_prompt=True)
    if rendered != expected:
        fail(f"chat template rendered {rendered!r}")
    ids = tokenizer.encode(rendered, add_special_tokens=False).ids
    wanted = [SPECIAL_TOKENS.index(t) for t in (BOS, START_OF_TURN)]
    if ids[:2] != wanted or ids.count(SPECIAL_TOKENS.index(END_OF_TURN)) != 3:
        fail(f"chat template did not encode turn markers as special ids: {ids[:8]}")


def tokenizer_config() -> dict[str, Any]:
    """``tokenizer_config.json`` in the layout transformers writes for Gemma."""
    added = {str(i): {"content": tok, "lstrip": False, "normalized": False, "rstrip": False,
                      "single_word": False, "special": True}
             for i, tok in enumerate(SPECIAL_TOKENS)}
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": True,
        "add_eos_token": False,
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "unk_token": UNK,
        "additional_special_tokens": [START_OF_TURN, END_OF_TURN],
        "added_tokens_decoder": added,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "padding_side": "left",
    }


def special_tokens_map() -> dict[str, Any]:
    return {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD, "unk_token": UNK,
            "additional_special_tokens": [START_OF_TURN, END_OF_TURN]}


def write_outputs(tokenizer: Tokenizer, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out / "tokenizer.json"))
    for name, content in (("tokenizer_config.json", tokenizer_config()),
                          ("special_tokens_map.json", special_tokens_map())):
        (out / name).write_text(json.dumps(content, indent=2, ensure_ascii=False) + "\n",
                                encoding="utf-8")


def corpus_stats(tokenizer: Tokenizer, corpus: Path) -> tuple[int, int]:
    """(tokens, characters) of a corpus file, encoded document by document without bos."""
    documents = corpus.read_text(encoding="utf-8").split(DOCUMENT_SEPARATOR)
    encodings = tokenizer.encode_batch(documents, add_special_tokens=False)
    return sum(len(e.ids) for e in encodings), sum(len(d) for d in documents)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--corpus", type=Path, default=Path("data/corpus/train.txt"),
                        help="training text (from scripts/build_corpus.py)")
    parser.add_argument("--valid", type=Path, default=Path("data/corpus/valid.txt"),
                        help="held-out text, only for statistics (skipped if missing)")
    parser.add_argument("--out", type=Path, default=Path("data/tokenizer"),
                        help="output folder for the tokenizer files")
    parser.add_argument("--vocab-size", type=int, default=4096, help="vocabulary size")
    parser.add_argument("--min-frequency", type=int, default=2,
                        help="minimum pair count for a merge")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if not args.corpus.is_file():
        fail(f"corpus {args.corpus} not found; run scripts/build_corpus.py first")
    if args.vocab_size <= 256 + len(SPECIAL_TOKENS):
        fail(f"--vocab-size must exceed {256 + len(SPECIAL_TOKENS)} (bytes + special tokens)")
    started = time.perf_counter()
    tokenizer = build_tokenizer()
    train(tokenizer, args.corpus, args.vocab_size, args.min_frequency)
    print(f"trained vocab of {tokenizer.get_vocab_size()} in {time.perf_counter() - started:.1f}s")
    print(f"byte-level round trip ok on {check_roundtrip(tokenizer)} texts")
    check_chat_template(tokenizer)
    print("chat template ok")
    write_outputs(tokenizer, args.out)
    for name, path in (("train", args.corpus), ("valid", args.valid)):
        if path.is_file():
            tokens, chars = corpus_stats(tokenizer, path)
            print(f"{name}: {tokens:,} tokens, {chars:,} chars, {chars / tokens:.2f} chars/token")
    print(f"wrote {args.out}/tokenizer.json, tokenizer_config.json, special_tokens_map.json")


if __name__ == "__main__":
    main()
