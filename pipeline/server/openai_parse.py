"""OpenAI API request bodies mapped onto the engine's shapes: `ParsedRequest` (prompts and one
`SamplingParams`), chat messages, tokenize and detokenize requests. Pure functions, no I/O;
used by the HTTP front end (pipeline/server/) in each of its worker processes.

Every field is type-checked here and every range by the engine's own `validate_params`, so a
bad field gets one HTTP 400 that names it (by the API's name for it: `api_param`); a field a
route does not implement is refused, never ignored.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from typing import Any

from ipc.messages import ChatMessage, LogitBias, SamplingParams, ToolCall
from ipc.params import MAX_LOGIT_BIAS, MAX_USER_CHARS, RequestError, validate_params
from pipeline.server.errors import bad
from pipeline.server.openai_structured import parse_structured
from pipeline.server.tools import parse_tools
from stages.chat_template import template_kwargs

Prompt = str | list[int] | list[ChatMessage]
# One API request may not queue more than this: its prompts, and prompts times n.
MAX_PROMPTS = 128
MAX_SEQUENCES = 256


# ---------------------------------------------------------------- field checks


def _get(body: dict[str, Any], name: str, kinds: tuple[type, ...], default: Any = None) -> Any:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) and bool not in kinds:  # JSON true is not a number here
        raise bad(name, f"{name} must be {_kind_names(kinds)}, got a boolean")
    if not isinstance(value, kinds):
        raise bad(name, f"{name} must be {_kind_names(kinds)}, got {type(value).__name__}")
    if isinstance(value, float) and not math.isfinite(value):
        raise bad(name, f"{name} must be a finite number")
    if float in kinds and isinstance(value, int) and abs(value) > 2**53:
        raise bad(name, f"{name} is too large, got {value}")  # float() would overflow
    return value


def _kind_names(kinds: tuple[type, ...]) -> str:
    names = {int: "an integer", float: "a number", str: "a string", bool: "a boolean",
             list: "an array", dict: "an object"}
    return " or ".join(names.get(k, k.__name__) for k in kinds if not (k is int and float in kinds))


def _stop_strings(body: dict[str, Any]) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        return [stop]
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        return list(stop)
    raise bad("stop", "stop must be a string or an array of strings")


def _int_list(body: dict[str, Any], name: str) -> list[int]:
    value = body.get(name)
    if value is None:
        return []
    if not isinstance(value, list) or not all(type(v) is int for v in value):
        raise bad(name, f"{name} must be an array of integers")
    return list(value)


# The fields each route implements. Any other field is a 400 that names it: a client must
# never believe that a field it sent took effect when it did not.
SAMPLING_FIELDS = frozenset({
    "model", "stream", "stream_options", "max_tokens", "temperature", "top_p", "n", "stop",
    "presence_penalty", "frequency_penalty", "logit_bias", "logprobs", "seed", "user",
    # hints that change nothing here (checked: _check_hints): the prefix cache finds shared
    # prefixes by their tokens, and there is one tier
    "prompt_cache_key", "service_tier",
    # vLLM's extensions
    "top_k", "min_p", "repetition_penalty", "min_tokens", "ignore_eos", "skip_special_tokens",
    "stop_token_ids", "include_stop_str_in_output", "priority",
    # structured outputs: OpenAI's, and vLLM's current and older names
    "response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
    "guided_grammar", "prompt_logprobs",
})
COMPLETION_FIELDS = SAMPLING_FIELDS | {"prompt", "echo", "best_of"}
CHAT_FIELDS = SAMPLING_FIELDS | {"messages", "max_completion_tokens", "top_logprobs", "tools",
                                 "tool_choice", "parallel_tool_calls", "chat_template_kwargs",
                                 "reasoning_effort"}
# Known fields we do not implement, with what to do instead.
NOT_IMPLEMENTED = {
    "suffix": "suffix (insertion) is not supported",
    "tools": "tools are for /v1/chat/completions",
    "tool_choice": "tool_choice is for /v1/chat/completions",
    "parallel_tool_calls": "parallel_tool_calls is for /v1/chat/completions",
    "functions": "functions are not supported",
    "function_call": "function_call is not supported",
    "guided_decoding_backend": "guided_decoding_backend cannot be chosen: this server has one",
    "guided_whitespace_pattern": "guided_whitespace_pattern is not supported",
    "chat_template": "chat_template is not supported: the model's own template is used",
    "chat_template_kwargs": "chat_template_kwargs is not supported here (it is for "
                            "/v1/chat/completions)",
    "continue_final_message": "continue_final_message is not supported",
    "add_generation_prompt": "add_generation_prompt is not supported (it is always on)",
}


def check_fields(body: dict[str, Any], known: frozenset[str]) -> None:
    """A 400 naming the first field of `body` that this route does not implement."""
    for name in body:
        if name in known:
            continue
        if name in NOT_IMPLEMENTED:
            raise bad(name, NOT_IMPLEMENTED[name])
        raise bad(name, f"unknown field {name!r}: this server does not implement it")


@dataclass
class ParsedRequest:
    """An API request as the engine takes it: one or more prompts, one SamplingParams."""

    prompts: list[Prompt]
    params: SamplingParams
    stream: bool = False
    include_usage: bool = False
    chat: bool = False
    logprobs_param: str = "logprobs"  # the API field that asked for logprobs
    structured_param: str = "response_format"  # the API field that set a structured output
    tools: Any = None  # pipeline.server.tools.ToolRequest, for a chat that gave tools
    echo: bool = False  # completions: the prompt comes back before the completion
    score_only: bool = False  # max_tokens 0: the one token the engine samples is dropped
    prompt_logprobs: int | None = None  # vLLM's prompt_logprobs field, as asked
    extra: dict[str, Any] = field(default_factory=dict)
    # EOS ids the server made stop token ids (AnswerReading.keep_special_tokens): an answer they
    # end reports no stop_reason, as one ended by EOS does
    eos_stop_ids: tuple[int, ...] = ()
    chat_template_kwargs: str = ""  # a chat's extra template variables, JSON text ("": none)
    reasoning: Any = None  # pipeline.server.reasoning.ReasoningSpec, with --reasoning-parser


def _user(body: dict[str, Any]) -> str:
    """OpenAI's `user`; the server prefixes the client's address (FrontEnd._run)."""
    user = _get(body, "user", (str,), "")
    limit = MAX_USER_CHARS - 64
    if len(user) > limit:
        raise bad("user", f"user must be at most {limit} characters, got {len(user)}")
    return str(user)


def parse_sampling(body: dict[str, Any], *, chat: bool) -> tuple[SamplingParams, str, str]:
    """SamplingParams from the OpenAI fields and the common extensions; (params, the name of
    the field that set logprobs, the name of the field that set a structured output)."""
    check_fields(body, CHAT_FIELDS if chat else COMPLETION_FIELDS)
    structured, structured_param = parse_structured(body)
    num = (int, float)
    max_tokens = _get(body, "max_tokens", (int,))
    if chat:
        max_tokens = _get(body, "max_completion_tokens", (int,), max_tokens)
    elif "max_tokens" not in body:
        max_tokens = 16  # OpenAI's default for completions
    n = _get(body, "n", (int,), 1)
    best_of = _get(body, "best_of", (int,))
    if best_of is not None and best_of != n:
        raise bad("best_of", "best_of is not supported unless it equals n")
    if chat:
        logprobs_param = "top_logprobs"
        want = _get(body, "logprobs", (bool,), False)
        top = _get(body, "top_logprobs", (int,))
        if top is not None and not want:
            raise bad("top_logprobs", "top_logprobs needs logprobs set to true")
        logprobs = (top or 0) if want else None
    else:
        logprobs_param = "logprobs"
        logprobs = _get(body, "logprobs", (int,))
    _check_hints(body)
    params = SamplingParams(
        max_tokens=max_tokens, temperature=float(_get(body, "temperature", num, 1.0)),
        stop_token_ids=_int_list(body, "stop_token_ids"),
        ignore_eos=_get(body, "ignore_eos", (bool,), False),
        skip_special_tokens=_get(body, "skip_special_tokens", (bool,), True),
        min_tokens=_get(body, "min_tokens", (int,), 0), top_p=float(_get(body, "top_p", num, 1.0)),
        top_k=_get(body, "top_k", (int,), 0), min_p=float(_get(body, "min_p", num, 0.0)),
        seed=_get(body, "seed", (int,)),
        repetition_penalty=float(_get(body, "repetition_penalty", num, 1.0)),
        presence_penalty=float(_get(body, "presence_penalty", num, 0.0)),
        frequency_penalty=float(_get(body, "frequency_penalty", num, 0.0)),
        stop=_stop_strings(body),
        include_stop_str_in_output=_get(body, "include_stop_str_in_output", (bool,), False),
        n=n, logprobs=logprobs, priority=_get(body, "priority", (int,), 0),
        user=_user(body), structured_outputs=structured,
        prompt_logprobs=_get(body, "prompt_logprobs", (int,)), logit_bias=_logit_bias(body))
    return params, logprobs_param, structured_param


SERVICE_TIERS = ("auto", "default")  # this server's one tier, by the names OpenAI gives it


def _check_hints(body: dict[str, Any]) -> None:
    """OpenAI's prompt_cache_key (a string) and service_tier (auto or default), checked.
    Neither changes what is run: the prefix cache keys a prompt's blocks by their tokens (a
    shared prefix is found without a key), and every request has the one tier."""
    _get(body, "prompt_cache_key", (str,))
    tier = body.get("service_tier")
    if tier is not None and tier not in SERVICE_TIERS:
        raise bad("service_tier", f"service_tier {tier!r} is not supported: this server has "
                                  f"one tier ({' or '.join(SERVICE_TIERS)})")


def _logit_bias(body: dict[str, Any]) -> list[LogitBias]:
    """OpenAI's logit_bias: {"<token id>": bias}; the ranges are validate_params' check."""
    value = _get(body, "logit_bias", (dict,), {})
    if len(value) > MAX_LOGIT_BIAS:  # (before converting a huge map)
        raise bad("logit_bias", f"logit_bias may bias at most {MAX_LOGIT_BIAS} tokens, got "
                                f"{len(value)}")
    out = []
    for key, bias in value.items():
        if not (key.isascii() and key.isdigit()):
            raise bad("logit_bias", f"logit_bias keys must be token ids (integers), got {key!r}")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)):
            raise bad("logit_bias", f"logit_bias[{key!r}] must be a number, got "
                                    f"{type(bias).__name__}")
        out.append(LogitBias(int(key), float(bias)))
    return out


def api_param(param: str | None, parsed: ParsedRequest | None = None,
              logprobs_param: str = "logprobs",
              structured_param: str = "response_format") -> str | None:
    """The API's name for an engine parameter: logprobs is logprobs or top_logprobs, the
    structured output is whichever field set it."""
    if parsed is not None:
        logprobs_param, structured_param = parsed.logprobs_param, parsed.structured_param
    if param == "logprobs":
        return logprobs_param
    if param == "structured_outputs":
        return structured_param
    return param


def check_params(params: SamplingParams, vocab_size: int, logprobs_param: str) -> None:
    """The engine's own range checks, turned into a 400 naming the API field."""
    try:
        validate_params(params, vocab_size)
    except RequestError as exc:
        param, message = exc.param, exc.message
        if param == "logprobs":  # the API's name for it: logprobs or top_logprobs
            message = logprobs_param + message.removeprefix("logprobs")
        raise bad(api_param(param, logprobs_param=logprobs_param) or "body", message) from None


def _stream_options(body: dict[str, Any], stream: bool) -> bool:
    options = _get(body, "stream_options", (dict,))
    if options is None:
        return False
    if not stream:
        raise bad("stream_options", "stream_options is only allowed with stream: true")
    for key in options:
        if key != "include_usage":
            raise bad(f"stream_options.{key}", f"stream_options.{key} is not supported")
    include = options.get("include_usage", False)
    if not isinstance(include, bool):
        raise bad("stream_options.include_usage", "include_usage must be a boolean")
    return include


def parse_prompts(value: Any, vocab_size: int, param: str, *,
                  empty_text: bool) -> list[Prompt]:
    """A completion's `prompt` or an embedding's `input`: a string, an array of strings, an
    array of token ids or an array of arrays of token ids (no empty array; empty_text: an
    empty string too), at most MAX_PROMPTS, every id in the vocabulary; else a 400 naming
    `param`."""
    def is_text(x: Any) -> bool:
        return isinstance(x, str) and (empty_text or bool(x))

    def is_ids(x: Any) -> bool:
        return isinstance(x, list) and bool(x) and all(type(t) is int for t in x)

    prompts: list[Any]  # (strings and token-id lists: Prompt without chats)
    if is_text(value):
        prompts = [value]
    elif is_ids(value):
        prompts = [list(value)]
    elif isinstance(value, list) and value and all(is_text(p) for p in value):
        prompts = list(value)
    elif isinstance(value, list) and value and all(is_ids(p) for p in value):
        prompts = [list(p) for p in value]
    else:
        raise bad(param, f"{param} must be a {'' if empty_text else 'non-empty '}string, an "
                  "array of them, an array of token ids or an array of arrays of token ids "
                  "(none empty)")
    if len(prompts) > MAX_PROMPTS:
        raise bad(param, f"at most {MAX_PROMPTS} prompts in one request, got {len(prompts)}")
    for p in prompts:
        outside = [t for t in p if not 0 <= t < vocab_size] if isinstance(p, list) else []
        if outside:
            raise bad(param, f"token ids {outside[:5]} are outside the vocabulary "
                             f"[0, {vocab_size})")
    return prompts


def parse_completion(body: dict[str, Any], vocab_size: int) -> ParsedRequest:
    echo = _get(body, "echo", (bool,), False)
    score_only = body.get("max_tokens") == 0 and type(body.get("max_tokens")) is int
    if score_only:
        if not (echo or body.get("prompt_logprobs") is not None):
            raise bad("max_tokens", "max_tokens may be 0 only with echo or prompt_logprobs "
                                    "(to score the prompt); otherwise at least 1")
        body = {**body, "max_tokens": 1}  # the engine samples one token, which is dropped
    prompts = parse_prompts(body.get("prompt"), vocab_size, "prompt", empty_text=True)
    params, lp_param, so_param = parse_sampling(body, chat=False)
    asked_plp = params.prompt_logprobs
    if echo and params.logprobs is not None:  # the prompt's tokens come with logprobs too
        params = dataclasses.replace(params, prompt_logprobs=max(params.logprobs,
                                                                 asked_plp or 0))
    check_params(params, vocab_size, lp_param)
    if len(prompts) * params.n > MAX_SEQUENCES:
        raise bad("n", f"{len(prompts)} prompts times n = {params.n} make "
                       f"{len(prompts) * params.n} sequences; at most {MAX_SEQUENCES} per request")
    stream = _get(body, "stream", (bool,), False)
    return ParsedRequest(prompts, params, stream, _stream_options(body, stream), False, lp_param,
                         so_param, echo=echo, score_only=score_only,
                         prompt_logprobs=asked_plp)


CHAT_ROLES = {"system": "system", "developer": "system", "user": "user",
              "assistant": "assistant", "tool": "tool"}


# Content parts that carry an image (OpenAI's image_url, and the input_image of its Responses
# API), refused by name: a request with one is never answered as if it had no image.
IMAGE_PARTS = ("image_url", "input_image", "image")


def _message_text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for i, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind in IMAGE_PARTS:  # (a multimodal checkpoint runs as its language model)
                raise bad(f"{where}.content[{i}]", f"an image content part ({kind}) cannot be "
                          "read: the engine runs language models only (vision towers are not "
                          "implemented)")
            if not (kind == "text" and isinstance(part.get("text"), str)):
                raise bad(f"{where}.content[{i}]", "only text content parts are supported")
            parts.append(part["text"])
        return "".join(parts)
    raise bad(f"{where}.content", "content must be a string or an array of text parts")


def parse_messages(body: dict[str, Any]) -> list[ChatMessage]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("messages", "messages must be a non-empty array")
    chat: list[ChatMessage] = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad(where, "each message must be an object")
        role = m.get("role")
        if not isinstance(role, str) or role not in CHAT_ROLES:
            raise bad(f"{where}.role", f"role must be one of {sorted(CHAT_ROLES)}, got {role!r}")
        for key in m:
            # a tool message's name is its function's (the call id says it already); a
            # refusal may come back null in an assistant message a client echoes
            known = (key in ("role", "content", "tool_calls", "tool_call_id")
                     or (key == "name" and role == "tool")
                     or (key == "refusal" and m[key] is None))
            if not known:
                raise bad(f"{where}.{key}", f"{where}.{key} is not supported")
        calls = _tool_calls(m.get("tool_calls"), where) if role == "assistant" else []
        content = m.get("content")
        text = "" if content is None and (calls or role == "assistant") else _message_text(
            content, where)
        call_id = ""
        if role == "tool":
            call_id = m.get("tool_call_id")
            if not isinstance(call_id, str):
                raise bad(f"{where}.tool_call_id", "a tool message needs its tool_call_id")
        chat.append(ChatMessage(CHAT_ROLES[role], text, calls, call_id))
    return chat


def _tool_calls(value: Any, where: str) -> list[ToolCall]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise bad(f"{where}.tool_calls", "tool_calls must be an array")
    calls = []
    for i, c in enumerate(value):
        fn = c.get("function") if isinstance(c, dict) else None
        if not (isinstance(fn, dict) and isinstance(fn.get("name"), str)
                and isinstance(fn.get("arguments", ""), str)):
            raise bad(f"{where}.tool_calls[{i}]", 'each tool call must be {"id": ..., "type": '
                      '"function", "function": {"name": ..., "arguments": "<JSON text>"}}')
        calls.append(ToolCall(str(c.get("id", "")), fn["name"], fn.get("arguments", "")))
    return calls


def parse_chat(body: dict[str, Any], vocab_size: int) -> ParsedRequest:
    chat = parse_messages(body)
    params, lp_param, so_param = parse_sampling(body, chat=True)
    tools = parse_tools(body)
    if tools is not None:
        if params.structured_outputs is not None:
            raise bad(so_param, f"{so_param} cannot be combined with tools (unless "
                                "tool_choice is none)")
        enforced = tools.structured()  # tool_choice required, or a named function
        if enforced is not None:
            params, so_param = dataclasses.replace(params, structured_outputs=enforced), "tools"
    check_params(params, vocab_size, lp_param)
    stream = _get(body, "stream", (bool,), False)
    if stream and params.prompt_logprobs is not None:
        raise bad("prompt_logprobs", "prompt_logprobs on a chat is for plain answers, not "
                                     "streams (completions stream them)")
    parsed = ParsedRequest([chat], params, stream, _stream_options(body, stream), True, lp_param,
                           so_param, tools=tools, prompt_logprobs=params.prompt_logprobs,
                           chat_template_kwargs=_template_kwargs(body))
    return parsed


REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high")  # OpenAI's


def _template_kwargs(body: dict[str, Any]) -> str:
    """chat_template_kwargs (vLLM's): an object of the template's extra variables, such as
    {"enable_thinking": false}; as JSON text, checked as the tokenizer stage will. OpenAI's
    reasoning_effort joins them as the template's `reasoning_effort` (as vLLM passes it:
    gpt-oss's template reads it; a template that does not ignores it)."""
    value = dict(_get(body, "chat_template_kwargs", (dict,)) or {})
    effort = _get(body, "reasoning_effort", (str,))
    if effort is not None:
        if effort not in REASONING_EFFORTS:
            raise bad("reasoning_effort", f"reasoning_effort must be one of "
                                          f"{list(REASONING_EFFORTS)}, got {effort!r}")
        if value.setdefault("reasoning_effort", effort) != effort:
            raise bad("reasoning_effort", "reasoning_effort and chat_template_kwargs."
                                          "reasoning_effort differ")
    if not value:
        return ""
    text = json.dumps(value)
    try:
        template_kwargs(text)
    except RequestError as exc:
        raise bad("chat_template_kwargs", exc.message) from None
    return text


@dataclass
class TokenizeRequest:
    """POST /tokenize (vLLM's): a prompt, or chat messages through the template."""

    prompt: str | None
    messages: list[ChatMessage] | None
    add_special_tokens: bool
    chat_template_kwargs: str = ""  # with messages: the template's variables (JSON text)


def parse_tokenize(body: dict[str, Any]) -> TokenizeRequest:
    check_fields(body, frozenset({"model", "prompt", "messages", "add_special_tokens",
                                  "add_generation_prompt", "chat_template_kwargs"}))
    if _get(body, "add_generation_prompt", (bool,), True) is not True:
        raise bad("add_generation_prompt", "add_generation_prompt must be true (the only "
                                           "template this server applies)")
    add_special = _get(body, "add_special_tokens", (bool,), True)
    if ("prompt" in body) == ("messages" in body):
        raise bad("prompt", "give exactly one of prompt and messages")
    if "prompt" in body:
        if body.get("chat_template_kwargs") is not None:
            raise bad("chat_template_kwargs", "chat_template_kwargs go with messages, not "
                                              "with a prompt")
        return TokenizeRequest(_get(body, "prompt", (str,), ""), None, add_special)
    return TokenizeRequest(None, parse_messages(body), add_special, _template_kwargs(body))


def parse_detokenize(body: dict[str, Any], vocab_size: int) -> list[int]:
    check_fields(body, frozenset({"model", "tokens"}))
    tokens = _int_list(body, "tokens")
    bad_ids = [t for t in tokens if not 0 <= t < vocab_size]
    if bad_ids:
        raise bad("tokens", f"token ids {bad_ids[:5]} are outside the vocabulary "
                            f"[0, {vocab_size})")
    return tokens
