"""OpenAI-style request bodies → `tandem.v1` GenerateRequests, and responses back to OpenAI's
JSON shapes. Every field is type-checked here; the bounds and the model-specific checks are
the gRPC path's (`router.limits`, `router.convert`), so both doors refuse the same things."""

from __future__ import annotations

import math

import grpc

from engine import InvalidRequestError, prompt
from router.limits import clip, shown
from tandem_client.types import SEEDS
from tandem_proto.v1 import generation_pb2 as pb

COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat runs to the context end
MAX_CHOICES = 16  # n, and prompts x n of one completions request
FINISH_NAMES = {pb.FINISH_REASON_STOP: "stop", pb.FINISH_REASON_LENGTH: "length",
                pb.FINISH_REASON_CANCELLED: "cancelled", pb.FINISH_REASON_ERROR: "error"}
# OpenAI's fields that change the output in ways this server does not offer: refused, not
# ignored, so a caller never gets output other than the one it asked for.
UNSUPPORTED = ("logprobs", "top_logprobs", "echo", "suffix", "logit_bias", "tools",
               "functions", "best_of", "presence_penalty", "frequency_penalty")
HTTP_OF = {  # gRPC status → (HTTP status, OpenAI error type)
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error"),
    grpc.StatusCode.PERMISSION_DENIED: (403, "permission_error"),
    grpc.StatusCode.NOT_FOUND: (404, "not_found_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable_error"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout_error"),
}


class ApiError(Exception):
    """Ends an HTTP request with `status` and an OpenAI error body naming `param`."""

    def __init__(self, message: str, status: int = 400, param: str | None = None,
                 type_: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.param, self.code = status, param, code
        self.type = type_ or ("invalid_request_error" if status < 500 else "server_error")

    @classmethod
    def of_status(cls, code: grpc.StatusCode, message: str) -> ApiError:
        status, type_ = HTTP_OF.get(code, (500, "server_error"))
        return cls(message, status, type_=type_, code=code.name.lower())

    def body(self) -> dict:
        return {"error": {"message": str(self), "type": self.type, "param": self.param,
                          "code": self.code}}


def check_model(body: dict, served: str) -> None:
    model = _get(body, "model", str, required=True)
    if model != served:
        raise ApiError(f"the model {clip(model)} does not exist; this server serves "
                       f"{served!r}", 404, "model", code="model_not_found")


def completion_requests(body, rid: str, max_model_len: int) -> list[pb.GenerateRequest]:
    """One GenerateRequest per choice of a /v1/completions body (prompts x n)."""
    prompts = _prompts(_get(_object(body), "prompt", (str, list), required=True))
    lp = body.get("logprobs")
    if isinstance(lp, (int, float)) and not isinstance(lp, bool):  # 0: the chosen tokens'
        raise ApiError("logprobs is not supported by this server", param="logprobs")
    return _choices(body, rid, prompts, COMPLETION_MAX_TOKENS, "max_tokens")


def chat_requests(body, rid: str, max_model_len: int) -> list[pb.GenerateRequest]:
    """One GenerateRequest per choice of a /v1/chat/completions body."""
    raw = _get(_object(body), "messages", list, required=True)
    chat = pb.ChatMessages(messages=[_message(m, i) for i, m in enumerate(raw)])
    key = "max_completion_tokens" if body.get("max_completion_tokens") is not None \
        else "max_tokens"
    fmt = _get(body, "response_format", dict)
    if fmt is not None and fmt.get("type", "text") != "text":
        raise ApiError(f"response_format {shown(fmt.get('type'))} is not supported "
                       "(only text)", param="response_format")
    choice = body.get("tool_choice")
    if choice not in (None, "none"):
        raise ApiError("tools are not supported", param="tool_choice")
    return _choices(body, rid, [pb.GenerateRequest(chat=chat)], max_model_len, key)


def _choices(body: dict, rid: str, prompts: list[pb.GenerateRequest], default_max: int,
             max_key: str) -> list[pb.GenerateRequest]:
    n = _get(body, "n", int)
    n = 1 if n is None else n
    for key in UNSUPPORTED:
        v = body.get(key)
        if v not in (None, False, 0, [], {}) and not (  # best_of n: every draw is a choice
                key == "best_of" and v == n and not isinstance(v, bool)):
            raise ApiError(f"{key} is not supported by this server", param=key)
    if not 1 <= n or len(prompts) * n > MAX_CHOICES:
        raise ApiError(f"n={shown(n, 40)} for {len(prompts)} prompt(s): at most "
                       f"{MAX_CHOICES} choices in all", param="n")
    sampling = _sampling(body, default_max, max_key)
    out = []
    for p in prompts:
        for j in range(n):
            req = pb.GenerateRequest()
            req.CopyFrom(p)
            req.sampling.CopyFrom(sampling)
            if n > 1 and sampling.HasField("seed"):  # n draws, not n copies of one draw
                req.sampling.seed = (sampling.seed + j) % SEEDS
            out.append(req)
    for i, req in enumerate(out):
        req.request_id = rid if len(out) == 1 else f"{rid}-{i}"
    return out


def _sampling(body: dict, default_max: int, max_key: str) -> pb.SamplingParams:
    s = pb.SamplingParams()
    t = _number(body, "temperature", 0.0, 2.0)
    if t is not None:
        s.temperature = t
    p = _number(body, "top_p", 0.0, 1.0)
    if p is not None:
        if p == 0.0:
            raise ApiError("top_p must be above 0", param="top_p")
        s.top_p = p
    m = _get(body, max_key, int)
    if m is not None and m < 1:
        raise ApiError(f"{max_key} must be at least 1, got {shown(m, 40)}", param=max_key)
    s.max_tokens = min(m if m is not None else default_max, (1 << 32) - 1)
    seed = _get(body, "seed", int)
    if seed is not None:
        if not -(1 << 63) <= seed < (1 << 63):
            raise ApiError(f"seed must be a 64-bit signed integer, got {shown(seed, 40)}",
                           param="seed")
        s.seed = seed % SEEDS
    stop = _get(body, "stop", (str, list))
    for i, one in enumerate([stop] if isinstance(stop, str) else stop or ()):
        if not isinstance(one, str):
            raise ApiError(f"stop[{i}] must be a string", param="stop")
        unicode_text(one, "stop")
    s.stop.extend([stop] if isinstance(stop, str) else stop or ())
    # vLLM's extensions that tandem's own API has too
    k = _get(body, "top_k", int)
    if k is not None and k > 0:
        s.top_k = min(k, (1 << 32) - 1)
    s.stop_token_ids.extend(_ids(_get(body, "stop_token_ids", list) or [], "stop_token_ids"))
    s.ignore_eos = bool(_get(body, "ignore_eos", bool))
    return s


def _prompts(prompt) -> list[pb.GenerateRequest]:
    """A completions prompt: a string, token ids, or a list of either."""
    if isinstance(prompt, str):
        return [pb.GenerateRequest(text=unicode_text(prompt, "prompt"))]
    if not prompt:
        raise ApiError("prompt is empty", param="prompt")
    if all(isinstance(x, int) and not isinstance(x, bool) for x in prompt):
        return [pb.GenerateRequest(token_ids=pb.TokenIds(ids=_ids(prompt, "prompt")))]
    if len(prompt) > MAX_CHOICES:
        raise ApiError(f"{len(prompt)} prompts: at most {MAX_CHOICES}", param="prompt")
    out = []
    for i, p in enumerate(prompt):
        if isinstance(p, str):
            out.append(pb.GenerateRequest(text=unicode_text(p, "prompt")))
        elif isinstance(p, list) and p:
            out.append(pb.GenerateRequest(token_ids=pb.TokenIds(ids=_ids(p, f"prompt[{i}]"))))
        else:
            raise ApiError(f"prompt[{i}] must be a string or a non-empty list of token ids",
                           param="prompt")
    return out


def _message(m, i: int) -> pb.ChatMessage:
    if not isinstance(m, dict):
        raise ApiError(f"messages[{i}] must be an object", param="messages")
    role = m.get("role")
    if not isinstance(role, str):
        raise ApiError(f"messages[{i}].role must be a string", param="messages")
    role = "system" if role == "developer" else role  # OpenAI's newer name for system
    content = m.get("content")
    if isinstance(content, list):  # content parts: text only
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or \
                    not isinstance(part.get("text"), str):
                raise ApiError(f"messages[{i}].content[{j}]: only text parts are supported",
                               param="messages")
            texts.append(part["text"])
        content = "".join(texts)
    if not isinstance(content, str):
        raise ApiError(f"messages[{i}].content must be a string or a list of text parts",
                       param="messages")
    return pb.ChatMessage(role=unicode_text(role, "messages"),
                          content=unicode_text(content, "messages"))


def unicode_text(text: str, param: str) -> str:
    """text, if it encodes as UTF-8: JSON's escapes can spell lone surrogates (half an emoji),
    which no protobuf string holds."""
    try:
        return prompt.unicode_text(text, param)
    except InvalidRequestError as e:
        raise ApiError(str(e), param=param) from None


def _ids(values: list, param: str) -> list[int]:
    for v in values:
        if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v < (1 << 32):
            raise ApiError(f"{param} holds {shown(v)}: token ids are integers from 0",
                           param=param)
    return values


def _object(body) -> dict:
    if not isinstance(body, dict):
        raise ApiError("the request body must be a JSON object")
    return body


def _get(body: dict, key: str, types, required: bool = False):
    value = body.get(key)
    if value is None:
        if required:
            raise ApiError(f"{key} is required", param=key)
        return None
    types = types if isinstance(types, tuple) else (types,)
    if isinstance(value, bool) and bool not in types or not isinstance(value, types):
        names = " or ".join({int: "an integer", str: "a string", list: "an array",
                             dict: "an object", bool: "a boolean"}[t] for t in types)
        raise ApiError(f"{key} must be {names}, got {shown(value, 40)}", param=key)
    return value


def _number(body: dict, key: str, lo: float, hi: float) -> float | None:
    value = body.get(key)
    if value is None:
        return None
    try:
        ok = (not isinstance(value, bool) and isinstance(value, (int, float))
              and math.isfinite(value) and lo <= value <= hi)
    except OverflowError:  # an integer beyond float's range
        ok = False
    if not ok:
        raise ApiError(f"{key} must be a number from {lo:g} to {hi:g}, got "
                       f"{shown(value, 40)}", param=key)
    return float(value)


# --- responses ------------------------------------------------------------------------------


def usage(prompt_tokens: int, completion_tokens: int, cached: int = 0) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached}}


def finish_name(resp: pb.GenerateResponse) -> str | None:
    return FINISH_NAMES.get(resp.finish_reason) if resp.HasField("usage") else None


def envelope(kind: str, rid: str, model: str, created: int, choices: list,
             use: dict | None = None) -> dict:
    """The outer object of a response or stream chunk (`kind`: OpenAI's `object`)."""
    prefix = "chatcmpl-" if kind.startswith("chat") else "cmpl-"
    out = {"id": prefix + rid, "object": kind, "created": created, "model": model,
           "choices": choices}
    if use is not None or not kind.endswith("chunk"):
        out["usage"] = use
    return out
