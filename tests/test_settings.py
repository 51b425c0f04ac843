"""Server settings are declared once (ServerConfig fields generate `dgemma serve`'s flags), and a request rule has
one home: the same message from the Python API, the CLI, the engine and the server."""

import argparse
import dataclasses
import subprocess
import sys

import httpx
import pytest

from server_fixtures import served_checkpoint, start_server

# every ServerConfig field: the flag that sets it, a value, and what the config must then hold
FLAGS = {
    "model_name": (["--served-model-name", "m"], "m"),
    "host": (["--host", "localhost"], "localhost"),
    "port": (["--port", "0"], 0),
    "api_keys": (["--api-key", "k1", "--api-key", "k2"], ("k1", "k2")),
    "metrics_key": (["--metrics-key", "ops"], "ops"),
    "max_concurrency": (["--max-concurrency", "3"], 3),
    "max_queue": (["--max-queue", "0"], 0),
    "max_cache_mb": (["--max-cache-mb", "2.5"], 2.5),
    "prefix_cache_mb": (["--prefix-cache-mb", "0"], 0),
    "max_prompt_tokens": (["--max-prompt-tokens", "100"], 100),
    "max_tokens": (["--max-tokens", "50"], 50),
    "max_n": (["--max-n", "2"], 2),
    "max_stop": (["--max-stop", "3"], 3),
    "max_stop_chars": (["--max-stop-chars", "9"], 9),
    "max_body_bytes": (["--max-body-bytes", "1000"], 1000),
    "shutdown_timeout": (["--shutdown-timeout", "0"], 0.0),
    "max_queue_seconds": (["--max-queue-seconds", "1.5"], 1.5),
    "request_timeout": (["--request-timeout", "7"], 7.0),
    "header_timeout": (["--header-timeout", "2"], 2.0),
    "body_timeout": (["--body-timeout", "3"], 3.0),
    "keep_alive_timeout": (["--keep-alive-timeout", "4"], 4.0),
    "max_connections": (["--max-connections", "5"], 5),
    "tokenizer_threads": (["--tokenizer-threads", "1"], 1),
    "image_threads": (["--image-threads", "3"], 3),
    "max_denoising_steps": (["--max-denoising-steps", "6"], 6),
    "max_temperature": (["--max-temperature", "1.5"], 1.5),
    "max_token_steps": (["--max-token-steps", "99"], 99),
    "cors_origins": (["--cors-origin", "http://a.example"], ("http://a.example",)),
    "allowed_hosts": (["--allowed-hosts", "a.example,b.example", "--allowed-host", "c"], ("a.example", "b.example",
                                                                                          "c")),
    "mode": (["--mode", "autoregressive"], "autoregressive"),
    "speculative_pacing": (["--speculative-pacing", "timed"], "timed"),
    "default_chat_template_kwargs": (["--default-chat-template-kwargs", '{"enable_thinking": true}'],
                                     '{"enable_thinking": true}'),
    "log_level": (["--log-level", "debug"], "debug"),
    "access_log": (["--no-access-log"], False),
}


def _parse(argv):
    from dgemma.server.command import add_arguments, config_from_args

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return config_from_args(parser.parse_args(argv)), parser


def test_every_setting_has_a_flag_that_reaches_the_config(monkeypatch):
    from dgemma.server.config import KEY_ENV, METRICS_KEY_ENV, ServerConfig

    monkeypatch.delenv(KEY_ENV, raising=False)
    monkeypatch.delenv(METRICS_KEY_ENV, raising=False)
    names = {f.name for f in dataclasses.fields(ServerConfig)} - {"images"}
    assert names == set(FLAGS)  # a new setting needs its flag here (and a declaration to pass)
    argv = [arg for args, _ in FLAGS.values() for arg in args]
    config, parser = _parse(argv)
    for name, (_, expected) in FLAGS.items():
        assert getattr(config, name) == expected, name
    assert _parse([])[0] == ServerConfig(model_name="demo")  # no flags: the declared defaults
    images, _ = _parse(["--image-tokens", "70", "--max-images", "2", "--fetch-image-urls"])
    assert (images.images.max_soft_tokens, images.images.max_images, images.images.fetch_urls) == (70, 2, True)


def test_help_lists_every_flag_with_its_default():
    _, parser = _parse([])
    helps = {flag: action.help for action in parser._actions for flag in action.option_strings}
    for args, _ in FLAGS.values():
        flag = args[0]
        assert helps.get(flag), flag
        assert "(default" in helps[flag] or flag == "--no-access-log", flag
    assert "(default 16)" in helps["--max-concurrency"] and "(default: no cap)" in helps["--max-temperature"]


def test_a_setting_out_of_range_is_one_line_naming_its_flag(capsys):
    from dgemma.errors import ConfigError
    from dgemma.server.command import main as serve_main
    from dgemma.server.config import ServerConfig

    with pytest.raises(ConfigError, match="^--max-concurrency must be >= 1$"):
        ServerConfig(max_concurrency=0)
    with pytest.raises(ConfigError, match="^--request-timeout must be > 0$"):
        ServerConfig(request_timeout=0.0)
    assert serve_main(["--max-connections", "0", "--port", "0"]) == 2
    assert capsys.readouterr().err == "error: --max-connections must be >= 1\n"
    assert serve_main(["--port", "99999"]) == 2  # the socket module raised OverflowError with a traceback
    assert capsys.readouterr().err == "error: --port must be <= 65535\n"
    for command in ("serve", "bench"):  # --threads -1 reached torch.set_num_threads: a RuntimeError traceback
        r = subprocess.run([sys.executable, "-m", "dgemma", command, "--threads", "-1"], capture_output=True, text=True)
        assert r.returncode == 2 and "'-1' is not a positive integer" in r.stderr and "Traceback" not in r.stderr


# ---- one rule, one message -----------------------------------------------------------------------------------
STEPS = "max_denoising_steps=0 must be an integer in [1, 10000]"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = start_server(served_checkpoint(tmp_path_factory))
    yield s
    s.stop()


def test_one_rule_gives_one_message_from_the_api_the_cli_and_the_server(server, capsys):
    from dgemma.cli import main
    from dgemma.sampling import SamplingParams, SamplingParamsError

    with pytest.raises(SamplingParamsError) as e:
        SamplingParams(max_denoising_steps=0)
    assert (str(e.value), e.value.param) == (STEPS, "max_denoising_steps")
    model = server.service.model
    with pytest.raises(SamplingParamsError, match=r"^max_denoising_steps=0 must be an integer in \[1, 10000\]$"):
        model.generate([5, 6], max_denoising_steps=0)
    assert main(["generate", "--model", str(model.directory), "--prompt-ids", "5,6", "--steps", "0"]) == 2
    assert capsys.readouterr().err == f"error: {STEPS.replace('max_denoising_steps', '--steps')}\n"  # its flag
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "hi", "dgemma_sampling": {
        "max_denoising_steps": 0}}, timeout=30)
    assert r.status_code == 400
    assert (r.json()["error"]["message"], r.json()["error"]["param"]) == (STEPS, "dgemma_sampling.max_denoising_steps")


@pytest.mark.parametrize("path, body, message, param", [
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, "max_tokens=0 must be an integer in [1, 1000000]",
     "max_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": -1},
     "max_completion_tokens=-1 must be an integer in [1, 1000000]", "max_completion_tokens"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 21}, "logprobs=21 must be an integer in [0, 20]", "logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "logprobs": True,
                              "top_logprobs": 21}, "top_logprobs=21 must be an integer in [0, 20]", "top_logprobs"),
])
def test_request_fields_are_checked_by_the_sampling_rule_under_their_own_name(server, path, body, message, param):
    """The request models no longer check these ranges: SamplingParams does, with the client's field name."""
    r = httpx.post(server.url + path, json=body, timeout=30)
    assert r.status_code == 400 and r.json()["error"] == {"message": message, "type": "invalid_request_error",
                                                          "param": param, "code": None}


def test_the_engine_refuses_what_its_decoding_cannot_follow_with_the_api_message(server):
    from dgemma.sampling import Grammar, SamplingParamsError

    model = server.service.model
    params = model.params(grammar=Grammar.regex("a+"), eos_token_ids=(1,))
    with pytest.raises(SamplingParamsError) as api:
        model.generate([5, 6], sampling="reference", grammar=Grammar.regex("a+"), eos_token_ids=(1,))
    with pytest.raises(SamplingParamsError) as engine:
        model.runner("diffusion", "reference").add_request([5, 6], params)
    assert str(api.value) == str(engine.value) == "constrained output needs the fast sampler"
    seeded = model.params(suffix="the end", eos_token_ids=(1,))
    with pytest.raises(SamplingParamsError) as engine:
        model.runner("autoregressive").add_request([5, 6], seeded)
    assert (str(engine.value), engine.value.param) == ("a suffix, template or edit needs fast diffusion decoding",
                                                       "suffix")
    with pytest.raises(SamplingParamsError) as api:
        model.generate([5, 6], mode="autoregressive", logprobs=2)
    with pytest.raises(SamplingParamsError) as engine:
        model.runner("autoregressive").add_request([5, 6], model.params(logprobs=2))
    assert str(api.value) == str(engine.value) == "logprobs applies to diffusion decoding, not to autoregressive decoding"


def test_each_option_is_declared_once_and_reaches_every_front_end():
    """options.OPTIONS makes the SamplingParams field, the CLI flag and the request field (dgemma_sampling's, or
    a top-level one for a knob); each is off by default; the opt-in ones are refused outside fast diffusion."""
    import dataclasses

    from dgemma.cli import build_parser
    from dgemma.options import OPT_IN, OPTIONS
    from dgemma.sampling.params import SamplingParams
    from dgemma.server.protocol import ChatCompletionRequest, DgemmaSampling

    defaults = {f.name: f.default for f in dataclasses.fields(SamplingParams)}
    assert len(OPT_IN) >= 6 and len(OPTIONS) >= len(OPT_IN) + 7
    for o in OPTIONS:
        assert defaults[o.name] is None
        value = True if o.type is bool else {3: 1.5} if o.type is dict else o.type(1)
        word = [] if o.type is bool else ["3=1.5"] if o.type is dict else [str(value)]
        argv = ["generate", "x", o.flag, *word]
        stored = o.normalize or (lambda v: v)
        assert stored(getattr(build_parser(argv).parse_args(argv), o.name)) == stored(value)
        if o.wire is None:
            assert o.modes == ("diffusion",)
            assert DgemmaSampling.model_validate({o.name: value}).overrides() == {o.name: value}
        else:
            wire = {str(k): v for k, v in value.items()} if o.type is dict else value
            body = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}],
                                                         o.wire: wire})
            assert {k: stored(v) for k, v in body.knobs().items()} == {o.name: stored(value)}


def test_a_diffusion_only_field_set_to_off_is_not_refused_elsewhere():
    """settled_kv_reuse=False means off, so autoregressive decoding takes it; logprobs=0 still asks for logprobs."""
    from dgemma.sampling import SamplingParams, SamplingParamsError

    SamplingParams(settled_kv_reuse=False).check_decoding("autoregressive", "fast", (1,), True)
    for asked in ({"settled_kv_reuse": True, "skip_settled": 1}, {"logprobs": 0}, {"early_commit": 1}):
        with pytest.raises(SamplingParamsError, match="applies to diffusion decoding"):
            SamplingParams(**asked).check_decoding("autoregressive", "fast", (1,), True)
