"""What routers in front of replicas (vllm-router, sglang-router) and token-counting clients ask a replica, in the
shapes vLLM and SGLang answer: POST /tokenize and /detokenize (vLLM's), POST /v1/chat/completions/render and
/v1/completions/render (vLLM's token-in requests: what vllm-router's cache_aware asks first), GET /get_load (the
object vllm-router reads; open like /health: it sends no key there), GET /server_info and /model_info (SGLang's,
with their older /get_ names: what sglang-router reads when a worker registers)."""

from __future__ import annotations

import uuid
from typing import Any

from fastapi import APIRouter, FastAPI, Request

from dgemma import __version__
from dgemma.errors import DgemmaError
from dgemma.sampling import SamplingParamsError
from dgemma.server import planning
from dgemma.server.errors import bad_request
from dgemma.server.planning import Plan
from dgemma.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    with_defaults,
)
from dgemma.server.responses import (
    DetokenizeResponse,
    Load,
    ModelInfo,
    RenderedRequest,
    ServerInfo,
    TokenizeResponse,
)
from dgemma.server.service import Service


def install(api: APIRouter, app: FastAPI, service: Service, responses: Any) -> None:
    """The keyed routes on `api` (the guarded router), /get_load on `app`; `responses(ok, *statuses)` documents."""

    @api.post("/tokenize", response_model=None, responses=responses(TokenizeResponse, 400, 401, 404, 413, 503))
    async def tokenize(body: TokenizeRequest, request: Request) -> Any:
        """A prompt's or a chat's ids, as the generation routes encode them: {count, max_model_len, tokens,
        token_strs}."""
        model = _ready(service, body.model)
        try:
            field, value = body.input()
            part = planning.partition(request.state.key, None)
            kwargs = with_defaults(body.chat_template_kwargs, service.config.template_defaults)
            chat = model.prompts.turn(body.tools, template_kwargs=kwargs) if body.messages else None
            ids = await service.off_loop(_encode, model, field, value, body.add_special_tokens, chat, part)
        except SamplingParamsError as e:
            raise bad_request(str(e), e.param) from None
        except DgemmaError as e:
            raise bad_request(str(e), "messages" if body.messages is not None else "prompt") from None
        strs = model.tokenizer.token_strs(ids) if body.return_token_strs else None
        return {"count": len(ids), "max_model_len": model.max_context, "tokens": ids, "token_strs": strs}

    @api.post("/v1/chat/completions/render", response_model=None,
              responses=responses(RenderedRequest, 400, 401, 404, 408, 413, 503))
    async def render_chat(body: ChatCompletionRequest, request: Request) -> Any:
        """The chat as /v1/chat/completions would run it, not run: vLLM's token-in request {request_id,
        token_ids, sampling_params, ...}; the same checks and 400s."""
        plans = await service.render(body, [service.chat_prompt(body)], "messages", request.state.key)
        return _rendered("chatcmpl", body, plans[0], service)

    @api.post("/v1/completions/render", response_model=None,
              responses=responses(list[RenderedRequest], 400, 401, 404, 408, 413, 503))
    async def render_completion(body: CompletionRequest, request: Request) -> Any:
        """Each prompt as /v1/completions would run it, not run: a list of vLLM's token-in requests."""
        plans = await service.render(body, planning.prompts(body), "prompt", request.state.key)
        return [_rendered("cmpl", body, plan, service) for plan in plans]

    @api.post("/detokenize", response_model=None, responses=responses(DetokenizeResponse, 400, 401, 404, 413, 503))
    async def detokenize(body: DetokenizeRequest) -> Any:
        """Token ids -> {prompt: their text}, special tokens spelled out."""
        model = _ready(service, body.model)
        vocab = model.module.cfg.text.vocab_size
        if (bad := next((t for t in body.tokens if not 0 <= t < vocab), None)) is not None:
            raise bad_request(f"token id {bad} is outside the vocabulary (0..{vocab - 1})", "tokens")
        return {"prompt": await service.off_loop(model.tokenizer.decode, body.tokens, False)}

    @api.get("/server_info", response_model=None, responses=responses(ServerInfo, 401))
    @api.get("/get_server_info", response_model=None, include_in_schema=False)
    async def server_info() -> Any:
        """SGLang's server facts that a router reads: the model, parallel sizes (tp_size: this replica's ranks)."""
        model = service.model
        return {"model_path": service.config.model_name, "served_model_name": service.config.model_name,
                "tp_size": _tp_size(model), "dp_size": 1, "version": __version__,
                "max_concurrency": service.config.max_concurrency,
                "context_length": model.max_context if model is not None else None}

    @api.get("/model_info", response_model=None, responses=responses(ModelInfo, 401))
    @api.get("/get_model_info", response_model=None, include_in_schema=False)
    async def model_info() -> Any:
        """SGLang's model facts: a generative model, its id."""
        return {"model_path": service.config.model_name, "tokenizer_path": None, "is_generation": True,
                "model_type": "diffusion_gemma"}

    @app.get("/get_load", response_model=None, responses=responses(Load))
    async def get_load() -> Any:
        """The load vllm-router's power_of_two compares (`load`: admitted sequences), with SGLang's figures beside
        it: those not yet in the batch, and their tokens (prompt + max_tokens)."""
        running = service.worker.running if service.worker is not None else 0
        return {"load": service.in_use, "num_reqs": service.in_use,
                "num_waiting_reqs": max(0, service.in_use - running), "num_tokens": service.tokens_in_use}


def _rendered(prefix: str, body: Any, plan: Plan, service: Service) -> dict[str, Any]:
    """vLLM's GenerateRequest for one prompt: its ids, and its sampling in vLLM's names as this server resolved it
    (the request's knobs as sent; the denoising schedule under `dgemma`)."""
    p = plan.params
    diffusion = service.config.mode == "diffusion"
    sampling = {"n": body.n, "temperature": p.t_max if diffusion else p.ar_temperature, "seed": p.seed,
                "max_tokens": p.max_new_tokens, "stop": list(p.stop), "logprobs": p.logprobs, **body.knobs()}
    if diffusion:
        sampling["dgemma"] = {"max_denoising_steps": p.max_denoising_steps, "entropy_bound": p.entropy_bound,
                              "t_min": p.t_min, "t_max": p.t_max}
    return {"request_id": f"{prefix}-{uuid.uuid4().hex}", "token_ids": plan.ids, "features": None,
            "sampling_params": sampling, "model": body.model or service.config.model_name, "stream": body.stream,
            "stream_options": body.stream_options.model_dump() if body.stream and body.stream_options else None,
            "cache_salt": body.cache_salt, "priority": 0}


def _tp_size(model: Any) -> int:
    group = model.module.parallel if model is not None else None
    return group.world if group is not None else 1


def _ready(service: Service, name: str | None):
    if error := service.unavailable():
        raise error
    service.check_model(name)
    return service.model


def _encode(model, field: str, value: Any, special: bool | None, chat: Any, partition: str | None) -> list[int]:
    """In a tokenizer thread: the ids the generation routes would give this prompt or chat (`chat`: its turn)."""
    if field == "prompt" and special is False:
        return model.check_ids(model.prompts.require_tokenizer().encode(value, add_bos=False))
    return model.encode_prompt(value, None, chat, partition)
