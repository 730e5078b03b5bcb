"""A conversation as the model's prompt: its chat template, with tools. Used by the tokenizer
stage (prompts) and the HTTP front end (/tokenize). The calls in an answer are read back by
pipeline/server/tool_parsers.py, in the format the prompt asked for.

A template that knows tools (it reads `tools`, as Qwen's, Hermes' and Llama 3.1's do) gets them
and the conversation's tool calls and results as transformers passes them. For one that does
not (SmolLM2's), the tools are described in the system message in the Hermes format that most
tool-trained open models know, calls are written `<tool_call>{"name": ..., "arguments": ...}
</tool_call>` and results come back as `<tool_response>` in a user turn (a format the
default tool parser reads).
"""

from __future__ import annotations

import json
from typing import Any

from jinja2 import TemplateError

from ipc.messages import ChatMessage, ToolSpec
from ipc.params import RequestError

CHAT_ROLES = ("system", "user", "assistant", "tool")
TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"

HERMES_TOOLS = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

For each function call, return a json object with function name and arguments within \
<tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""


def knows_tools(tokenizer: Any) -> bool:
    """Whether the tokenizer's chat template renders `tools` itself."""
    template = getattr(tokenizer, "chat_template", None)
    return isinstance(template, str) and "tools" in template


def tool_json(t: ToolSpec) -> dict[str, Any]:
    return {"type": "function", "function": {"name": t.name, "description": t.description,
                                             "parameters": json.loads(t.parameters)}}


# apply_chat_template's own arguments, and what the template is already given: not a
# chat_template_kwargs variable a request may set
RESERVED_KWARGS = frozenset({"conversation", "messages", "tools", "documents", "tokenize",
                             "add_generation_prompt", "continue_final_message", "chat_template",
                             "return_dict", "return_tensors", "padding", "truncation",
                             "max_length", "tokenizer_kwargs", "return_assistant_tokens_mask",
                             # the special tokens every template is given
                             "bos_token", "eos_token", "unk_token", "sep_token", "pad_token",
                             "cls_token", "mask_token", "additional_special_tokens"})


def template_kwargs(text: str) -> dict[str, Any]:
    """A request's chat_template_kwargs (JSON text of an object; "": none), checked: an
    object, whose names are not apply_chat_template's own."""
    if not text:
        return {}
    try:
        value = json.loads(text)
    except ValueError:
        raise RequestError("chat_template_kwargs must be a JSON object",
                           "chat_template_kwargs") from None
    if not isinstance(value, dict):
        raise RequestError("chat_template_kwargs must be an object", "chat_template_kwargs")
    taken = sorted(RESERVED_KWARGS & value.keys())
    if taken:
        raise RequestError(f"chat_template_kwargs may not set {taken}: the server sets them",
                           "chat_template_kwargs")
    return value


def render(tokenizer: Any, messages: list[ChatMessage], tools: list[ToolSpec],
           kwargs: dict[str, Any] | None = None) -> str:
    """The prompt text of a conversation, ready for the assistant's turn; kwargs: the
    template's extra variables (template_kwargs)."""
    kwargs = kwargs or {}
    if not messages:
        raise RequestError("messages is empty")
    for m in messages:
        if m.role not in CHAT_ROLES:
            raise RequestError(f"unknown chat role {m.role!r} (use one of {CHAT_ROLES})")
    if getattr(tokenizer, "chat_template", None) is None:
        raise RequestError("this model has no chat template; send a plain prompt")
    uses_tools = bool(tools) or any(m.role == "tool" or m.tool_calls for m in messages)
    if uses_tools and knows_tools(tokenizer):
        conversation = [_native(m) for m in messages]
        return _apply(tokenizer, conversation, tools=[tool_json(t) for t in tools] or None,
                      **kwargs)
    conversation = [_hermes(m) for m in messages]
    if tools:
        described = HERMES_TOOLS.format(tools="\n".join(json.dumps(tool_json(t))
                                                        for t in tools))
        if conversation[0]["role"] == "system":
            conversation[0]["content"] += "\n\n" + described
        else:
            conversation.insert(0, {"role": "system", "content": described})
    return _apply(tokenizer, conversation, **kwargs)


def _apply(tokenizer: Any, conversation: list[dict[str, Any]], **kwargs: Any) -> str:
    """The template applied; what it refuses (its raise_exception: roles that do not
    alternate, Mistral's 9-character call ids) is the request's error."""
    try:
        return str(tokenizer.apply_chat_template(conversation, tokenize=False,
                                                 add_generation_prompt=True, **kwargs))
    except TemplateError as exc:
        raise RequestError(f"the model's chat template refused the conversation: {exc}"
                           ) from None


def _native(m: ChatMessage) -> dict[str, Any]:
    out: dict[str, Any] = {"role": m.role, "content": m.content}
    if m.tool_calls:
        out["tool_calls"] = [{"id": c.id, "type": "function", "function": {
            "name": c.name, "arguments": _arguments(c.arguments)}} for c in m.tool_calls]
    if m.role == "tool":
        out["tool_call_id"] = m.tool_call_id
    return out


def _hermes(m: ChatMessage) -> dict[str, Any]:
    if m.role == "tool":
        return {"role": "user",
                "content": f"<tool_response>\n{m.content}\n</tool_response>"}
    content = m.content
    for c in m.tool_calls:
        call = json.dumps({"name": c.name, "arguments": _arguments(c.arguments)})
        content += f"{chr(10) if content else ''}{TOOL_CALL_OPEN}\n{call}\n{TOOL_CALL_CLOSE}"
    return {"role": m.role, "content": content}


def _arguments(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text  # a client may send back what a model wrote; keep it as it is
