"""Server settings: limits on requests and admission, and the security switches. Checked once at start-up."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field

from dgemma.errors import ConfigError
from dgemma.image_limits import ImageLimits
from dgemma.options import MODES
from dgemma.sampling.params import Limits

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")


@dataclass(frozen=True)
class ServerConfig:
    model_name: str = "demo"
    host: str = "127.0.0.1"
    api_keys: tuple[str, ...] = field(default=(), repr=False)  # never printed
    max_concurrency: int = 16  # sequences decoded together (the engine's batch)
    max_queue: int = 64  # admitted sequences waiting for a batch row; more are refused with 429
    max_prompt_tokens: int | None = None  # None: the model's context
    max_tokens: int | None = None  # cap on max_tokens per choice; None: the model's context
    max_n: int = 8  # choices per request (n x prompts)
    max_stop: int = 8  # stop strings per request
    max_stop_chars: int = 256  # characters per stop string
    max_body_bytes: int = 4 << 20
    shutdown_timeout: float = 30.0  # after SIGTERM, in-flight requests get this long before they are aborted
    cors_origins: tuple[str, ...] = ()  # empty: no CORS headers at all
    allowed_hosts: tuple[str, ...] = ()  # Host names accepted besides the loopback names; "*": any Host
    mode: str = "diffusion"  # or "autoregressive": the encoder as a next-token model
    tokenizer_threads: int = 2  # prompts tokenized / templated at once, off the event loop
    max_queue_seconds: float | None = None  # admitted requests not in the batch after this long: 503
    request_timeout: float | None = None  # the longest a request may run (arrival to last token); None: no cap
    header_timeout: float = 10.0  # seconds from connecting (or from the last response) to a complete header
    body_timeout: float = 30.0  # seconds to receive a request's whole body
    keep_alive_timeout: float = 5.0  # an idle keep-alive connection is closed after this long
    max_connections: int = 512  # open connections; more are answered 503 and closed
    max_cache_mb: float | None = None  # KV cache one request may need (prompt + max_tokens); None: no cap
    prefix_cache_mb: int = 1024  # earlier prompts' and answers' KV kept for reuse (diffusion mode); 0: none
    max_denoising_steps: int | None = None  # fairness caps (diffusion): steps per canvas, None: no cap
    max_temperature: float | None = None  # highest sampling temperature a request may ask
    max_token_steps: int | None = None  # max_tokens x max_denoising_steps one request may ask
    images: ImageLimits = ImageLimits()  # image inputs: caps per image and request, whether URLs are fetched

    def __post_init__(self) -> None:
        for name in ("max_concurrency", "max_n", "max_stop", "max_stop_chars", "max_body_bytes", "tokenizer_threads",
                     "max_connections"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 1")
        for name in ("max_queue", "prefix_cache_mb"):
            if getattr(self, name) < 0:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 0")
        for name in ("max_prompt_tokens", "max_tokens", "max_denoising_steps", "max_token_steps"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 1")
        if self.max_n > self.capacity:
            raise ConfigError(f"--max-n ({self.max_n}) exceeds --max-concurrency + --max-queue ({self.capacity})")
        if self.max_temperature is not None and not self.max_temperature > 0:
            raise ConfigError("--max-temperature must be > 0")
        if self.max_cache_mb is not None and not self.max_cache_mb > 0:
            raise ConfigError("--max-cache-mb must be > 0")
        if self.shutdown_timeout < 0:
            raise ConfigError("--shutdown-timeout must be >= 0")
        for name in ("max_queue_seconds", "request_timeout", "header_timeout", "body_timeout", "keep_alive_timeout"):
            if getattr(self, name) is not None and not getattr(self, name) > 0:
                raise ConfigError(f"--{name.replace('_', '-')} must be > 0")
        if any(not k for k in self.api_keys):
            raise ConfigError("--api-key must not be empty")
        if not self.loopback and not self.allowed_hosts:
            raise ConfigError(f"--host {self.host} is not a loopback address: name the Host headers clients will "
                              "send with --allowed-hosts NAME[,NAME] (or --allowed-hosts '*' to accept any)")
        if self.mode not in MODES:
            raise ConfigError(f"--mode {self.mode!r} must be one of {', '.join(MODES)}")

    @property
    def limits(self) -> Limits:
        """The request caps, for the one request validator (SamplingParams.validate)."""
        cache = None if self.max_cache_mb is None else int(self.max_cache_mb * 2**20)
        diffusion = self.mode == "diffusion"  # denoising steps mean nothing to the autoregressive mode
        return Limits(self.max_prompt_tokens, self.max_tokens, self.max_stop, self.max_stop_chars, cache,
                      self.max_denoising_steps if diffusion else None, self.max_temperature,
                      self.max_token_steps if diffusion else None)

    @property
    def capacity(self) -> int:
        """Sequences admitted at once (running + queued)."""
        return self.max_concurrency + self.max_queue

    @property
    def loopback(self) -> bool:
        return is_loopback(self.host)


def is_loopback(host: str) -> bool:
    name = host.strip("[]").lower().rstrip(".")
    if name in LOOPBACK_NAMES or name.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False
