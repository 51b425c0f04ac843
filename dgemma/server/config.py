"""Server settings, each declared once with its `dgemma serve` flag, help, default and range: limits on requests
and admission, deadlines, and the security switches. Checked once at start-up."""

from __future__ import annotations

import argparse
import functools
import ipaddress
import json
from dataclasses import Field, dataclass, field, fields
from typing import Any

from dgemma.errors import ConfigError
from dgemma.image_limits import ImageLimits, add_image_options, limits_from_args
from dgemma.options import MODE_HELP, MODES, PACING_HELP, PACINGS
from dgemma.sampling.params import Limits

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
KEY_ENV = "DGEMMA_API_KEY"
METRICS_KEY_ENV = "DGEMMA_METRICS_KEY"


def setting(value: Any, help: str, flag: str | tuple[str, ...] | None = None, *, least: float | None = None,
            above: float | None = None, most: float | None = None, shown: str | None = None, repr: bool = True,
            **argparse: Any) -> Any:
    """A ServerConfig field (default `value`) with its flag (default --field-name), `help` (+ the default, or `shown`),
    lowest value (`least`; `above`: strictly; None passes), highest (`most`), other `add_argument` options; tuple
    value: repeatable."""
    meta = {"help": help, "flag": flag, "least": least, "above": above, "most": most, "shown": shown,
            "argparse": argparse}
    return field(default=value, repr=repr, metadata=meta)


def _split(values: list[str]) -> tuple[str, ...]:  # ["a,b", "c"] -> ("a", "b", "c")
    return tuple(name.strip() for value in values for name in value.split(",") if name.strip())


@dataclass(frozen=True)
class ServerConfig:
    """Each field is one `dgemma serve` flag (`add_flags` declares them, `from_args` reads them back)."""

    model_name: str = setting("demo", "model id clients send", "--served-model-name", shown="the directory's name",
                              default=None)
    host: str = setting("127.0.0.1", "address to bind (0.0.0.0 for all, with --allowed-hosts)")
    port: int = setting(8000, "port (0: any free port, printed at start)", least=0, most=65535)
    api_keys: tuple[str, ...] = setting((), f"accepted bearer key (repeatable; also ${KEY_ENV}). Without keys the "
                                        "API is open", "--api-key", shown="none", repr=False)  # never printed
    metrics_key: str | None = setting(None, f"bearer key that reads all of /metrics, and nothing else (also "
                                      f"${METRICS_KEY_ENV}). With it or --api-key, an API key reads only its own "
                                      "series there", shown="none", repr=False)
    max_concurrency: int = setting(16, "sequences decoded together (the engine's batch)", least=1)
    max_queue: int = setting(64, "admitted sequences waiting for a batch row; more are refused with 429", least=0)
    max_cache_mb: float | None = setting(None, "largest KV cache one request may need (its prompt + max_tokens), "
                                         "MiB; larger requests are refused with 400 before any work", above=0,
                                         shown="no cap")
    prefix_cache_mb: int = setting(1024, "MiB of KV cache kept from earlier prompts and answers, so a chat's next "
                                   "turn or a shared system prompt is not encoded again (least recently used out "
                                   "first; outputs are unchanged; every mode; 0: off)", least=0)
    max_prompt_tokens: int | None = setting(None, "longest prompt in tokens", least=1, shown="the context")
    max_tokens: int | None = setting(None, "largest max_tokens a request may ask", least=1, shown="the context")
    max_n: int = setting(8, "choices per request, n x prompts", least=1)
    max_stop: int = setting(8, "stop strings per request", least=1)
    max_stop_chars: int = setting(256, "characters per stop string", least=1)
    max_body_bytes: int = setting(4 << 20, "request body cap in bytes", least=1, shown="4 MiB")
    shutdown_timeout: float = setting(30.0, "seconds in-flight requests get to finish after SIGTERM before they "
                                      "are aborted", least=0)
    # deadlines and connection limits: what keeps one client from holding the others up
    max_queue_seconds: float | None = setting(None, "a request not in the batch after this long is answered 503 "
                                              "with Retry-After", above=0, shown="no limit")
    request_timeout: float | None = setting(None, "seconds a request may run from arrival to its last token; later "
                                            "it is aborted with 408 (requests may ask less with dgemma_timeout)",
                                            above=0, shown="no limit")
    header_timeout: float = setting(10.0, "seconds a client has to send a complete request header, from "
                                    "connecting or from the previous response", above=0)
    body_timeout: float = setting(30.0, "seconds a client has to send the whole request body", above=0)
    keep_alive_timeout: float = setting(5.0, "an idle keep-alive connection is closed after this many seconds",
                                        above=0)
    max_connections: int = setting(512, "open connections; more are answered 503 and closed", least=1)
    tokenizer_threads: int = setting(2, "prompts tokenized at once, in threads off the event loop", least=1)
    image_threads: int = setting(1, "requests with images prepared at once (decoding, the vision tower), in threads "
                                 "of their own at a lower CPU priority, so that images never hold text prompts up",
                                 least=1)
    # fairness caps: what one request may cost the others; beyond them a request is refused with 400 naming the
    # field (a checkpoint default above a cap is lowered to it)
    max_denoising_steps: int | None = setting(None, "most denoising steps per canvas a request may ask "
                                              "(dgemma_sampling.max_denoising_steps)", least=1,
                                              shown="no cap beyond 10,000")
    max_temperature: float | None = setting(None, "highest temperature a request may ask (temperature, "
                                            "dgemma_sampling.t_max)", above=0, shown="no cap")
    max_token_steps: int | None = setting(None, "most max_tokens x max_denoising_steps one request may ask: the "
                                          "decoder work it can cause", least=1, shown="no cap")
    cors_origins: tuple[str, ...] = setting((), "allow browser calls from this origin (repeatable)", "--cors-origin",
                                            shown="CORS off")
    allowed_hosts: tuple[str, ...] = setting((), "Host headers to accept besides the loopback names (repeatable; "
                                             "others are refused). Required with a non-loopback --host; '*' accepts "
                                             "any", ("--allowed-hosts", "--allowed-host"), shown="none",
                                             metavar="NAME[,NAME]")
    default_chat_template_kwargs: str | None = setting(
        None, "chat template arguments every chat request gets unless it sets them itself (vLLM's flag): a JSON "
        'object, e.g. \'{"enable_thinking": true}\' to think by default', shown="none", metavar="JSON")
    mode: str = setting(MODES[0], MODE_HELP, choices=MODES)
    speculative_pacing: str = setting(PACINGS[0], PACING_HELP, choices=PACINGS)
    log_level: str = setting("info", "server log level", choices=("debug", "info", "warning", "error"))
    access_log: bool = setting(True, "do not log each request", "--no-access-log", action="store_false")
    images: ImageLimits = ImageLimits(local_files=False)  # their flags: image_limits.add_image_options

    def __post_init__(self) -> None:
        for f in fields(self):
            _check_setting(f, getattr(self, f.name))
        if self.max_n > self.capacity:
            raise ConfigError(f"--max-n ({self.max_n}) exceeds --max-concurrency + --max-queue ({self.capacity})")
        if any(not k for k in self.api_keys):
            raise ConfigError("--api-key must not be empty")
        if self.metrics_key is not None and (not self.metrics_key or self.metrics_key in self.api_keys):
            raise ConfigError("--metrics-key must not be empty, nor one of the --api-key keys")
        self.template_defaults  # noqa: B018 (parsed now: a bad --default-chat-template-kwargs is refused at start-up)
        if not self.loopback and not self.allowed_hosts:
            raise ConfigError(f"--host {self.host} is not a loopback address: name the Host headers clients will "
                              "send with --allowed-hosts NAME[,NAME] (or --allowed-hosts '*' to accept any)")

    @functools.cached_property
    def template_defaults(self) -> dict[str, Any]:
        """--default-chat-template-kwargs as the object a request's chat_template_kwargs are laid over (parsed and
        checked once)."""
        if self.default_chat_template_kwargs is None:
            return {}
        from dgemma.chat.turn import check_template_kwargs
        from dgemma.sampling import SamplingParamsError

        try:
            return check_template_kwargs(json.loads(self.default_chat_template_kwargs), None)
        except (ValueError, SamplingParamsError) as e:
            raise ConfigError(f"--default-chat-template-kwargs: {e}") from None

    @staticmethod
    def add_flags(p: argparse.ArgumentParser) -> None:
        """One flag per setting, from the declarations above; then the image caps."""
        for f in fields(ServerConfig):
            if "help" not in f.metadata:
                continue
            m, options = f.metadata, dict(f.metadata["argparse"])
            shown = f"(default: {m['shown']})" if m["shown"] else f"(default {f.default})"
            help = m["help"] if options.get("action") == "store_false" else f"{m['help']} {shown}"
            metavar = _flags(f)[0].lstrip("-").replace("-", "_").upper()
            if isinstance(f.default, tuple):
                options = {"action": "append", "default": [], "metavar": metavar} | options
            elif "action" not in options:
                scalar = {"int": int, "float": float, "str": str}[f.type.split(" | ")[0]]  # the annotation's text
                options = {"type": scalar, "default": f.default} | options
                options = ({} if "choices" in options else {"metavar": metavar}) | options
            p.add_argument(*_flags(f), dest=f.name, help=help, **options)
        add_image_options(p, fetch=True)

    @classmethod
    def from_args(cls, args: argparse.Namespace, **given: Any) -> ServerConfig:
        """The settings `add_flags` parsed (repeated values joined, comma lists split); `given` set the rest."""
        values = {f.name: tuple(getattr(args, f.name)) if isinstance(f.default, tuple) else getattr(args, f.name)
                  for f in fields(cls) if "help" in f.metadata}
        values["allowed_hosts"] = _split(values["allowed_hosts"])
        return cls(**values | {"images": limits_from_args(args, args.fetch_image_urls, local_files=False)} | given)

    @property
    def limits(self) -> Limits:
        """The request caps, for the one request validator (SamplingParams.validate)."""
        cache = None if self.max_cache_mb is None else int(self.max_cache_mb * 2**20)
        diffusion = self.mode == "diffusion"  # denoising steps mean nothing to the other modes
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


def _flags(f: Field) -> tuple[str, ...]:
    flag = f.metadata["flag"] or "--" + f.name.replace("_", "-")
    return (flag,) if isinstance(flag, str) else flag


def _check_setting(f: Field, value: Any) -> None:
    """A setting within its declared range (None: unset, always allowed), or the ConfigError naming its flag."""
    m, flag = f.metadata, _flags(f)[0] if "help" in f.metadata else ""
    if value is None or not m:
        return
    if m["least"] is not None and value < m["least"]:
        raise ConfigError(f"{flag} must be >= {m['least']}")
    if m["above"] is not None and not value > m["above"]:
        raise ConfigError(f"{flag} must be > {m['above']}")
    if m["most"] is not None and value > m["most"]:
        raise ConfigError(f"{flag} must be <= {m['most']}")
    if "choices" in m["argparse"] and value not in m["argparse"]["choices"]:
        raise ConfigError(f"{flag} {value!r} must be one of {', '.join(m['argparse']['choices'])}")
