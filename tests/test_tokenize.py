"""vLLM's /tokenize and /detokenize, and the routes routers read (/get_load, /server_info, /model_info): the ids
are the ones the generation routes use (their usage counts them), the shapes are vLLM's and SGLang's, mistakes are
400s naming the field, and the keyed routes want the key."""

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
        assert httpx.get(server.url + "/server_info").status_code == 401
        assert _post(server, "/tokenize", {"prompt": "a"}, key="k1").status_code == 200
        assert httpx.get(server.url + "/get_load").status_code == 200
    finally:
        server.stop()
