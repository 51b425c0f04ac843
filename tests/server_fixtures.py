"""Server test fixtures: a tiny served checkpoint (reference weights, a byte-level BPE tokenizer, a chat
template) and a live uvicorn server on a free loopback port."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from pathlib import Path

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Block diffusion denoises a canvas of tokens in a few parallel steps.",
    "Hello world! Say hello to the server, the engine and the tokenizer.",
    "Once upon a time there was a small model that answered every question with random words.",
    "user assistant system developer: what is the capital of France? Paris is the capital.",
    "0123456789 +-*/=()[]{}<>|,.;:!? 'quoted' \"double\" emojis are bytes too.",
] * 20


# Gemma 4's control tokens (turns, tools, the thought channel) and a reduced copy of its chat template (gemma4.jinja)
GEMMA4_TOKENS = ("<|turn>", "<turn|>", "<|tool>", "<tool|>", "<|tool_call>", "<tool_call|>", "<|tool_response>",
                 "<tool_response|>", '<|"|>', "<|channel>", "<channel|>", "<|think|>")
GEMMA4_TEMPLATE = (Path(__file__).parent / "gemma4.jinja").read_text()


def write_tokenizer(directory: Path, vocab_size: int, specials: tuple[str, ...] = (),
                    template: str = CHAT_TEMPLATE) -> None:
    """A byte-level BPE trained on CORPUS: <pad> 0, <eos> 1, <bos> 2, then `specials` (special tokens too)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<pad>", "<eos>", "<bos>", *specials],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    assert tok.get_vocab_size() <= vocab_size and tok.token_to_id("<eos>") == 1
    tok.save(str(directory / "tokenizer.json"))
    config = {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>", "add_bos_token": True,
              "chat_template": template}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))


def build_served_checkpoint(directory: Path, max_new_tokens: int = 16, steps: int = 12, **tokenizer) -> Path:
    """Config "a" (vocab 384, canvas 8) with a tokenizer (`write_tokenizer`'s options) and short defaults, built
    once per directory.
    Its generation config has no EOS ids, so requests run to max_tokens (random weights emit <eos> after
    30-180 tokens); `load_with_eos` serves the same weights with EOS ids."""
    from reference import CONFIGS, build_reference

    if (directory / "tokenizer.json").is_file():
        return directory
    directory.mkdir(parents=True, exist_ok=True)
    build_reference("a", directory)
    write_tokenizer(directory, CONFIGS["a"]["text"]["vocab_size"], **tokenizer)
    generation = {"max_new_tokens": max_new_tokens, "max_denoising_steps": steps, "eos_token_id": []}
    (directory / "generation_config.json").write_text(json.dumps(generation))
    return directory


# ---- a live server on 127.0.0.1 -------------------------------------------------------------------------------
_CHECKPOINTS: dict[str, Path] = {}


def served_checkpoint(tmp_path_factory) -> Path:
    """Built once per test session (transformers is slow to import), shared by the server test modules."""
    base = str(tmp_path_factory.getbasetemp())
    if base not in _CHECKPOINTS:
        _CHECKPOINTS[base] = build_served_checkpoint(tmp_path_factory.getbasetemp() / "served_ckpt")
    return _CHECKPOINTS[base]


def gemma4_checkpoint(tmp_path_factory) -> Path:
    """The served checkpoint's weights with Gemma 4's control tokens and chat template (tools, thinking)."""
    import shutil

    directory = tmp_path_factory.getbasetemp() / "gemma4_ckpt"
    if not directory.exists():
        shutil.copytree(served_checkpoint(tmp_path_factory), directory)
        write_tokenizer(directory, 384, GEMMA4_TOKENS, GEMMA4_TEMPLATE)
    return directory


class LiveServer:
    """The app under uvicorn in a thread, on a free loopback port; `stop()` shuts it down as uvicorn would."""

    def __init__(self, app):
        import uvicorn

        from dgemma.server.command import _bind
        from dgemma.server.connections import uvicorn_config

        self.app = app
        self.sock = _bind("127.0.0.1", 0)  # the socket `dgemma serve` listens on
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn_config(app, app.state.service.config, log_level="warning", timeout_graceful_shutdown=5)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    @property
    def service(self):
        return self.app.state.service

    def start(self, ready: bool = True, timeout: float = 60.0) -> LiveServer:
        import httpx

        self.thread.start()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                status = httpx.get(self.url + "/health", timeout=2).status_code
                if status == 200 or not ready:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.05)
        raise TimeoutError("the server did not become ready")

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(15)
        self.sock.close()


def load_with_eos(checkpoint: Path, eos: tuple[int, ...] = (1,)):
    import dgemma

    model = dgemma.load(checkpoint)
    model.defaults = model.defaults.replace(eos_token_ids=eos)
    return model


def start_server(checkpoint: Path, loader=None, ready: bool = True, **config) -> LiveServer:
    import dgemma
    from dgemma.server.app import create_app
    from dgemma.server.config import ServerConfig

    config.setdefault("model_name", "tiny")
    app = create_app(ServerConfig(**config), loader or (lambda: dgemma.load(checkpoint)))
    return LiveServer(app).start(ready=ready)


@contextlib.contextmanager
def openai_server(checkpoint: Path, **config):
    """(a live server of `checkpoint` with EOS id 1, an `openai` client for it), stopped on exit."""
    import openai

    server = start_server(checkpoint, loader=lambda: load_with_eos(checkpoint), **config)
    try:
        yield server, openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    finally:
        server.stop()


def check_tool_calls(choice, schemas: dict, name: str | None = None, count: int | None = None) -> None:
    """A choice that ended in calls (`count` of them when given), each to `name` when given, with an id and
    arguments that validate against that tool's schema in `schemas`."""
    import jsonschema_rs

    calls = choice.message.tool_calls
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert count is None or len(calls) == count
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert name is None or call.function.name == name
        jsonschema_rs.validate(schemas[call.function.name], json.loads(call.function.arguments))


def streamed_tool_calls(client, **kwargs):
    """(the tool-call deltas, the last finish reason) of a streamed chat reply, and the same request's whole
    reply (its first choice)."""
    whole = client.chat.completions.create(**kwargs).choices[0]
    deltas, reasons = [], []
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        for c in chunk.choices:
            deltas += c.delta.tool_calls or []
            reasons.append(c.finish_reason)
    return deltas, reasons[-1], whole


def raw_exchange(server: LiveServer, data: bytes, wait: float = 5.0) -> bytes:
    """Send `data` on a fresh connection and read until the server closes it (or `wait` passes: the bytes read,
    then b"<still open>")."""
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.settimeout(wait)
        if data:
            sock.sendall(data)
        out = b""
        try:
            while chunk := sock.recv(65536):
                out += chunk
        except TimeoutError:
            out += b"<still open>"
        return out


def error_of(response: bytes) -> tuple[int, dict]:
    """(status, the OpenAI error object) of one raw HTTP response."""
    head, _, body = response.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)["error"]


def wait_until(predicate, timeout: float, interval: float = 0.02) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()
