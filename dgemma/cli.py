"""`dgemma` command line: one dispatcher over the sub-commands. User mistakes print one line and exit 2."""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import sys
from collections.abc import Iterator

from dgemma.errors import DgemmaError, SamplingParamsError
from dgemma.image_limits import add_image_options, limits_from_args
from dgemma.options import (OPTIONS, SAMPLINGS, add_mode_option, add_model_options, add_parallel_option,
                            add_threads_option, apply_threads, check_modes)


def load_model_from_args(args: argparse.Namespace):
    from dgemma.api import load_model_from_args as load  # torch: only once a command runs, so --help stays fast

    apply_threads(args)
    model = load(args)
    if model.module.parallel is not None:
        import atexit

        from dgemma.parallel import leave

        atexit.register(leave)
        if model.module.parallel.rank:  # rank 0 prints; the others run the same steps
            sys.stdout = open(os.devnull, "w")
    if getattr(args, "speculative_pacing", None):
        model.speculative_pacing = args.speculative_pacing
    return model


def cmd_info(args: argparse.Namespace) -> int:
    model = load_model_from_args(args)
    info = model.describe()
    if args.json:
        print(json.dumps(info))
    else:
        for key, value in info.items():
            print(f"{key:>22}: {value}")
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from dgemma.display import print_stream

    if (args.prompt is None) == (args.prompt_ids is None):
        raise DgemmaError("give a PROMPT or --prompt-ids, not both and not neither")
    _check_mode_options(args)
    if args.image and args.prompt_ids is not None:
        raise DgemmaError("--image goes with a PROMPT text, not --prompt-ids")
    ids = None if args.prompt_ids is None else _parse_ids(args.prompt_ids)
    limits = limits_from_args(args)
    model = load_model_from_args(args)
    model.image_limits = limits
    text = _stdin(model).removesuffix("\n") if args.prompt == "-" else args.prompt  # -: a pipe's text
    prompt = text if ids is None else ids
    if args.image:  # one user turn: the images, then the text
        prompt = [{"role": "user", "content": [*({"type": "image", "image": f} for f in args.image),
                                               {"type": "text", "text": prompt}]}]
    elif (args.chat or args.think) and isinstance(prompt, str):
        prompt = [{"role": "user", "content": prompt}]
    options = _decoding(args) | {"grammar": _grammar(args)}
    if args.json:
        print(json.dumps(model.generate(prompt, **options).to_dict()))
        return 0
    events = model.stream(prompt, drafts=args.visual, **options)
    print_stream(events, visual=args.visual, show_ids=model.tokenizer is None)
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    """A conversation on the terminal: each line a user turn, each answer streamed; the prefix cache keeps the
    conversation's cache between turns, so a turn encodes only its new message (and what the last answer's cache
    lacked)."""
    from dgemma.cache import PrefixCache
    from dgemma.display import print_stream

    _check_mode_options(args)
    model = load_model_from_args(args)
    if model.tokenizer is None:
        raise DgemmaError(f"{model.directory}: dgemma chat needs a checkpoint with a tokenizer (tokenizer.json)")
    model.prefix_cache = PrefixCache(args.prefix_cache_mb << 20) if args.prefix_cache_mb else None
    start = [{"role": "system", "content": args.system}] if args.system else []
    messages, interactive, options, turn = list(start), sys.stdin.isatty(), _decoding(args), 0
    if interactive:
        print("dgemma chat: a line is a turn; /reset forgets the conversation, /exit or Ctrl-D leaves, Ctrl-C stops "
              "an answer", file=sys.stderr)
    for line in _shared(model, _lines("> " if interactive else "")):
        if line in ("/exit", "/quit"):
            break
        if line == "/reset":
            messages = list(start)
            continue
        seed = None if args.seed is None else args.seed + turn
        turn += 1
        try:
            result = print_stream(model.stream(messages + [{"role": "user", "content": line}], drafts=False,
                                               **options | {"seed": seed}))
        except KeyboardInterrupt:  # the answer stops; the conversation goes on without this turn
            print("\n[stopped]", file=sys.stderr)
            continue
        messages += [{"role": "user", "content": line}, {"role": "assistant", "content": result.text}]
    return 0


def _stdin(model) -> str:
    """Standard input's text; under tensor parallelism rank 0's, on every rank."""
    group = model.module.parallel
    if group is None:
        return sys.stdin.read()
    return group.from_rank0(sys.stdin.read() if group.rank == 0 else None)


def _shared(model, lines: Iterator[str]) -> Iterator[str]:
    """`lines` as rank 0 reads them, on every rank under tensor parallelism (the others read nothing)."""
    group = model.module.parallel
    if group is None:
        yield from lines
        return
    while (line := group.from_rank0(next(lines, None) if group.rank == 0 else None)) is not None:
        yield line


def _lines(prompt: str) -> Iterator[str]:
    """Non-empty input lines, stripped, until end of input."""
    while True:
        try:
            line = input(prompt).strip()
        except EOFError:
            return
        if line:
            yield line


def _decoding(args: argparse.Namespace) -> dict:
    """The decoding options `_add_decoding_options` adds, as `Model.generate` / `stream` take them."""
    thinking = {"think": True} if args.think else {}
    if args.max_thinking_tokens is not None:
        thinking["max_thinking_tokens"] = args.max_thinking_tokens
    return _fields(args) | thinking | {"stop": tuple(args.stop) or None, "seed": args.seed, "mode": args.mode,
                                       "sampling": args.sampling}


def _fields(args: argparse.Namespace) -> dict:
    """The SamplingParams fields the decoding flags set (None: not given)."""
    return {"max_new_tokens": args.max_new_tokens, "max_denoising_steps": args.steps, "t_min": args.t_min,
            "t_max": args.t_max, "entropy_bound": args.entropy_bound, "ar_temperature": args.ar_temperature,
            **{o.name: getattr(args, o.name) for o in OPTIONS}}


def _check_mode_options(args: argparse.Namespace) -> None:
    """A flag of another decoding would be ignored: refused instead (`options.check_modes`), naming the flag."""
    if args.mode != "diffusion" and args.sampling == "reference":
        raise DgemmaError(f"--sampling reference applies to diffusion decoding; --mode {args.mode} samples with "
                          "--ar-temperature (and --seed)")
    if args.speculative_pacing and args.mode != "speculative":
        raise DgemmaError(f"--speculative-pacing applies to --mode speculative, not to --mode {args.mode}")
    check_modes([k for k, v in _fields(args).items() if v is not None], args.mode, args.sampling)


def _message(e: DgemmaError, args: argparse.Namespace) -> str:
    """An error about a request field a flag set names the flag (`--steps 0`, not max_denoising_steps=0)."""
    param = getattr(e, "param", None)
    if not isinstance(e, SamplingParamsError) or not hasattr(args, "steps") or param not in _fields(args):
        return str(e)
    flag = "--steps" if param == "max_denoising_steps" else "--" + param.replace("_", "-")
    return re.sub(rf"\b{param}\b", flag, str(e), count=1)


def _grammar(args: argparse.Namespace):
    """--json-schema FILE / --regex / --grammar FILE -> a Grammar (None: free text)."""
    from dgemma.sampling import Grammar

    if args.regex is not None:
        return Grammar.regex(args.regex, "--regex")
    for flag, path, make in (("--json-schema", args.json_schema, Grammar.json_schema),
                             ("--grammar", args.grammar, Grammar.lark)):
        if path is not None:
            try:
                text = open(path, encoding="utf-8").read()
            except OSError as e:
                raise DgemmaError(f"{flag} {path}: {e.strerror}") from None
            return make(text, flag)
    return None


def _parse_ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise DgemmaError(f"--prompt-ids must be comma-separated integers, got {text!r}") from None


def _add_generate(sub) -> None:
    p = sub.add_parser("generate", help="generate text from a prompt",
                       description="Generate with block diffusion (or autoregressively) from a prompt.")
    p.add_argument("prompt", nargs="?", help="prompt text (- reads it from standard input)")
    p.add_argument("--prompt-ids", help="prompt as comma-separated token ids, e.g. 2,651,1024")
    add_model_options(p)
    add_parallel_option(p)
    add_threads_option(p)
    p.add_argument("--chat", action="store_true", help="wrap the prompt as a user turn of the chat template")
    p.add_argument("--image", action="append", default=[], metavar="FILE",
                   help="an image the prompt is about (repeatable; implies --chat; needs Pillow and a checkpoint with "
                        "a vision tower; the caps below apply)")
    add_image_options(p)
    _add_decoding_options(p)
    shape = p.add_mutually_exclusive_group()
    shape.add_argument("--json-schema", metavar="FILE", help="the output is JSON valid against this JSON schema file")
    shape.add_argument("--regex", help="the output matches this regular expression (whole text)")
    shape.add_argument("--grammar", metavar="FILE", help="the output matches this Lark grammar (llguidance dialect)")
    out = p.add_mutually_exclusive_group()
    out.add_argument("--json", action="store_true", help="print one JSON object: ids, text, statistics")
    out.add_argument("--visual", action="store_true", help="show the canvas refining in place, then the text")
    p.set_defaults(fn=cmd_generate)


def _add_chat(sub) -> None:
    p = sub.add_parser("chat", help="chat on the terminal",
                       description="Chat with the model: each input line is a user turn of the chat template, each "
                                   "answer streams as it is committed; earlier turns are not encoded again (the "
                                   "prefix cache). Reads lines from a pipe too.")
    add_model_options(p)
    add_threads_option(p)
    add_parallel_option(p)
    p.add_argument("--system", help="a system message before the conversation")
    p.add_argument("--prefix-cache-mb", type=int, default=1024,
                   help="MiB of KV cache kept between turns (default 1024; 0: every turn encodes the whole "
                        "conversation)")
    _add_decoding_options(p, seed_help="random seed of the first turn; turn i uses seed + i")
    p.set_defaults(fn=cmd_chat)


def _add_decoding_options(p: argparse.ArgumentParser,
                          seed_help: str = "random seed (same seed, same output)") -> None:
    p.add_argument("--max-new-tokens", type=int, help="exact number of tokens at most (default: checkpoint's)")
    p.add_argument("--steps", type=int, help="maximum denoising steps per canvas")
    p.add_argument("--t-min", type=float, help="final temperature of the linear schedule")
    p.add_argument("--t-max", type=float, help="initial temperature of the linear schedule")
    p.add_argument("--entropy-bound", type=float, help="entropy budget for accepting tokens per step")
    _add_request_options(p)
    p.add_argument("--seed", type=int, help=seed_help)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--sampling", choices=SAMPLINGS, default=SAMPLINGS[0],
                   help="fast: continuous batching, per-request RNG (default); reference: transformers draw for draw")
    add_mode_option(p)
    p.add_argument("--ar-temperature", type=float,
                   help="autoregressive and speculative modes: sampling temperature (0 = greedy)")
    p.add_argument("--think", action="store_true",
                   help="thinking mode (chat; the template's enable_thinking): the thought is shown apart, before "
                        "the answer")
    p.add_argument("--max-thinking-tokens", type=int, metavar="N",
                   help="with --think: the thought closes within N tokens and the answer follows")


def _add_request_options(p: argparse.ArgumentParser) -> None:
    """One flag per declared option (options.OPTIONS): the sampling knobs, and the diffusion options that change
    outputs, off by default (docs/performance.md measures each)."""
    for o in OPTIONS:
        if o.type is bool:
            p.add_argument(o.flag, action="store_true", default=None, help=f"opt-in: {o.help}")
        elif o.parse is not None:
            p.add_argument(o.flag, type=o.parse, action="append", metavar=o.metavar, help=o.help)
        else:
            p.add_argument(o.flag, type=o.type, metavar=o.metavar,
                           help=f"opt-in: {o.help} (default off)" if o.opt_in else o.help)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("dgemma")
    except PackageNotFoundError:  # run from a checkout that was not installed
        return "unknown"


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dgemma", description="Run, serve and fine-tune DiffusionGemma models.")
    parser.add_argument("--debug", action="store_true", help="show tracebacks for errors")
    parser.add_argument("--version", action="version", version=f"dgemma {_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    p = sub.add_parser("info", help="load a checkpoint and describe it")
    add_model_options(p)
    add_threads_option(p)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(fn=cmd_info)
    _add_generate(sub)
    _add_chat(sub)
    wanted = next((a for a in (sys.argv[1:] if argv is None else argv) if not a.startswith("-")), None)
    for name, module, help in (("serve", "dgemma.server.command", "serve an OpenAI-compatible HTTP API"),
                               ("train", "dgemma.train.command", "train or fine-tune (full or LoRA)"),
                               ("bench", "dgemma.bench", "benchmark dgemma against the reference and AR decoding"),
                               ("quantize", "dgemma.convert", "write a quantized (compressed-tensors) checkpoint")):
        _add_delegated(sub, name, module, help, load=name == wanted)
    return parser


def _add_delegated(sub, name: str, module: str, help: str, load: bool) -> None:
    """A sub-command whose options and body live in its own module, imported only when that command runs."""
    import importlib

    p = sub.add_parser(name, help=help, description=help[0].upper() + help[1:] + ".")
    if load:
        mod = importlib.import_module(module)
        mod.add_arguments(p)
        p.set_defaults(fn=mod.run)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s: %(message)s")
    if getattr(args, "tensor_parallel_size", 1) > 1 and "WORLD_SIZE" not in os.environ and \
            getattr(args, "replicas", 1) == 1:  # with --replicas, each worker starts its own ranks
        from dgemma.launch import launch_ranks

        return launch_ranks(args.tensor_parallel_size, sys.argv[1:] if argv is None else argv)
    try:
        return args.fn(args)
    except DgemmaError as e:
        if args.debug:
            raise
        print(f"error: {_message(e, args)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # output piped into e.g. `head`, which stopped reading
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
