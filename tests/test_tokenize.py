"""vLLM's /tokenize, /detokenize and /render routes, and the routes routers read (/get_load, /server_info,
/model_info): the ids are the ones the generation routes use (their usage counts them), the shapes are vLLM's and
SGLang's, mistakes are 400s naming the field, and the keyed routes want the key."""

import httpx
import pytest

from server_fixtures import served_checkpoint, start_server

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hello to the fox."}]


def _post(server, path: str, body: dict, key: str | None = None) -> httpx.Response:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    return httpx.post(server.url + path, json=body, headers=headers, timeout=30)


def test_tokenize_counts_what_generation_counts(eos_server, openai_client):
    text = _post(eos_server, "/tokenize", {"model": "tiny", "prompt": "The quick brown fox", "return_token_strs": True})
    body = text.json()
    assert text.status_code == 200 and set(body) == {"count", "max_model_len", "tokens", "token_strs"}
    done = openai_client.completions.create(model="tiny", prompt="The quick brown fox", max_tokens=2)
    assert body["count"] == len(body["tokens"]) == done.usage.prompt_tokens
    assert body["max_model_len"] == openai_client.models.list().data[0].max_model_len
    assert body["token_strs"][0] == "<bos>" and len(body["token_strs"]) == body["count"]
    plain = _post(eos_server, "/tokenize", {"prompt": "The quick brown fox", "add_special_tokens": False}).json()
    assert plain["tokens"] == body["tokens"][1:] and plain["token_strs"] is None
    chat = _post(eos_server, "/tokenize", {"model": "tiny", "messages": CHAT, "add_generation_prompt": True,
                                           "continue_final_message": False, "chat_template_kwargs": {}}).json()
    reply = openai_client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=2)
    assert chat["count"] == reply.usage.prompt_tokens


def test_render_gives_the_request_generation_runs(eos_server, openai_client):
    """vLLM's token-in request: the ids the chat and completion routes encode (their usage counts them; /tokenize
    lists them), and the sampling as the server resolves it (temperature 0 without a seed: seed 0)."""
    rendered = _post(eos_server, "/v1/chat/completions/render", {"model": "tiny", "messages": CHAT,
                                                                 "max_tokens": 3, "temperature": 0, "top_k": 5})
    body = rendered.json()
    assert rendered.status_code == 200 and body["request_id"].startswith("chatcmpl-")
    tokens = _post(eos_server, "/tokenize", {"messages": CHAT}).json()["tokens"]
    reply = openai_client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=3)
    assert body["token_ids"] == tokens and len(tokens) == reply.usage.prompt_tokens
    sampling = body["sampling_params"]
    assert (sampling["max_tokens"], sampling["seed"], sampling["top_k"], sampling["n"]) == (3, 0, 5, 1)
    assert body["model"] == "tiny" and body["features"] is None and body["stream"] is False
    prompts = ["The quick brown fox", "Hello"]
    many = _post(eos_server, "/v1/completions/render", {"prompt": prompts, "seed": 11}).json()
    assert [r["token_ids"] for r in many] == [_post(eos_server, "/tokenize", {"prompt": p}).json()["tokens"]
                                              for p in prompts]
    assert [r["sampling_params"]["seed"] for r in many] == [11, 11]


@pytest.mark.parametrize("path, body, param", [
    ("/v1/chat/completions/render", {"messages": CHAT, "tool_choice": "required"}, "tool_choice"),
    ("/v1/chat/completions/render", {"messages": CHAT, "max_tokens": 0}, "max_tokens"),
    ("/v1/completions/render", {"prompt": ""}, "prompt"),
    ("/v1/completions/render", {"prompt": "a", "top_p": 2}, "top_p"),
])
def test_render_refuses_what_generation_refuses(eos_server, path, body, param):
    generate = _post(eos_server, path.removesuffix("/render"), body)
    response = _post(eos_server, path, body)
    assert response.status_code == generate.status_code == 400
    assert response.json()["error"]["param"] == generate.json()["error"]["param"] == param


def test_detokenize_gives_the_text_back(eos_server):
    ids = _post(eos_server, "/tokenize", {"prompt": "Hello world!"}).json()["tokens"]
    assert _post(eos_server, "/detokenize", {"model": "tiny", "tokens": ids}).json() == {"prompt": "<bos>Hello world!"}


@pytest.mark.parametrize("path, body, param", [
    ("/tokenize", {}, "prompt"),
    ("/tokenize", {"prompt": "a", "messages": CHAT}, "messages"),
    ("/tokenize", {"prompt": ""}, "prompt"),
    ("/tokenize", {"prompt": 5}, "prompt"),
    ("/tokenize", {"messages": CHAT, "add_generation_prompt": False}, "add_generation_prompt"),
    ("/tokenize", {"messages": CHAT, "continue_final_message": True}, "continue_final_message"),
    ("/tokenize", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {
        "url": "data:image/png;base64,AAAA"}}]}]}, "messages"),
    ("/detokenize", {"tokens": [1, -1]}, "tokens"),
    ("/detokenize", {"tokens": [10 ** 9]}, "tokens"),
    ("/detokenize", {"tokens": "1 2"}, "tokens"),
])
def test_mistakes_are_400s_naming_the_field(eos_server, path, body, param):
    response = _post(eos_server, path, body)
    assert response.status_code == 400 and response.json()["error"]["param"] == param


def test_an_unknown_model_is_404(eos_server):
    assert _post(eos_server, "/tokenize", {"model": "other", "prompt": "a"}).status_code == 404
    assert _post(eos_server, "/v1/completions/render", {"model": "other", "prompt": "a"}).status_code == 404


def test_routes_routers_read(eos_server):
    load = httpx.get(eos_server.url + "/get_load").json()
    assert load == {"load": 0, "num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0}
    for path in ("/server_info", "/get_server_info"):
        assert httpx.get(eos_server.url + path).json()["model_path"] == "tiny"
    assert httpx.get(eos_server.url + "/model_info").json()["is_generation"] is True


def test_keyed_routes_want_the_key_and_get_load_does_not(tmp_path_factory):
    server = start_server(served_checkpoint(tmp_path_factory), api_keys=("k1",))
    try:
        assert _post(server, "/tokenize", {"prompt": "a"}).status_code == 401
        assert _post(server, "/detokenize", {"tokens": [3]}).status_code == 401
        assert _post(server, "/v1/completions/render", {"prompt": "a"}).status_code == 401
        assert httpx.get(server.url + "/server_info").status_code == 401
        assert _post(server, "/tokenize", {"prompt": "a"}, key="k1").status_code == 200
        assert httpx.get(server.url + "/get_load").status_code == 200
    finally:
        server.stop()
