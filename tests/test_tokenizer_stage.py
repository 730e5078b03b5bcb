"""Tests for stages.tokenizer: prompt, chat and token-id requests, validation with clear
RequestError messages, and the error answer to a malformed AddRequest."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import msgpack
import pytest
from transformers import AutoTokenizer

from ipc.codec import Codec, ProtocolError, encode
from ipc.messages import (
    AddRequest,
    ChatMessage,
    ErrorKind,
    RequestOutputs,
    SamplingParams,
    TokenizedRequest,
)
from ipc.params import RequestError, validate_params
from stages.tokenizer import TokenizerCore, _reject_malformed, error_output

REPLY = "ipc:///tmp/client-reply"
PROMPT = "Héllo wörld, 日本語のテキスト 🚀 The quick brown fox."


def _req(*, prompt: str | None = None, prompt_token_ids: list[int] | None = None,
         messages: list[ChatMessage] | None = None, request_id: str = "req-1",
         **params: Any) -> AddRequest:
    return AddRequest(request_id, REPLY, prompt, prompt_token_ids, messages,
                      SamplingParams(**params), 12.5)


def _core(folder: Path, max_model_len: int = 512) -> TokenizerCore:
    tok = AutoTokenizer.from_pretrained(folder)
    return TokenizerCore(str(folder), max_model_len, len(tok))


@pytest.fixture(scope="module")
def tiny_core(tiny_model_dir: Path) -> TokenizerCore:
    return _core(tiny_model_dir)


@pytest.fixture(scope="module")
def hf_tiny(tiny_model_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(tiny_model_dir)


# ---------------------------------------------------------------- well-formed requests


@pytest.mark.parametrize("model", ["tiny", "default"])
def test_plain_prompt_tokenizes_like_autotokenizer(request: pytest.FixtureRequest,
                                                   model: str) -> None:
    folder: Path = request.getfixturevalue(f"{model}_model_dir")
    core = _core(folder)
    out = core.process(_req(prompt=PROMPT, max_tokens=5, temperature=0.0))
    expected = AutoTokenizer.from_pretrained(folder)(PROMPT)["input_ids"]
    assert out.prompt_token_ids == list(expected)
    assert isinstance(out, TokenizedRequest)
    assert (out.request_id, out.reply_to, out.arrival_time) == ("req-1", REPLY, 12.5)
    assert out.params == SamplingParams(max_tokens=5, temperature=0.0)


def test_chat_applies_chatml_template(tiny_core: TokenizerCore, hf_tiny: Any) -> None:
    messages = [ChatMessage("system", "Be brief."), ChatMessage("user", "Grüße, 日本?"),
                ChatMessage("assistant", "Ja."), ChatMessage("user", "🚀")]
    out = tiny_core.process(_req(messages=messages))
    expected = ("<|im_start|>system\nBe brief.<|im_end|>\n"
                "<|im_start|>user\nGrüße, 日本?<|im_end|>\n"
                "<|im_start|>assistant\nJa.<|im_end|>\n<|im_start|>user\n🚀<|im_end|>\n"
                "<|im_start|>assistant\n")
    assert hf_tiny.decode(out.prompt_token_ids) == expected
    assert out.prompt_token_ids == hf_tiny(expected, add_special_tokens=False)["input_ids"]
    im_start = hf_tiny.convert_tokens_to_ids("<|im_start|>")
    assert out.prompt_token_ids.count(im_start) == 5  # special tokens, not their spelling


def test_chat_with_default_model(default_model_dir: Path) -> None:
    core = _core(default_model_dir)
    out = core.process(_req(messages=[ChatMessage("user", "What is 2+2?")]))
    hf = AutoTokenizer.from_pretrained(default_model_dir)
    text = hf.decode(out.prompt_token_ids)
    assert "<|im_start|>user\nWhat is 2+2?<|im_end|>\n" in text
    assert text.endswith("<|im_start|>assistant\n")
    expected = hf.apply_chat_template([{"role": "user", "content": "What is 2+2?"}],
                                      tokenize=False, add_generation_prompt=True)
    assert out.prompt_token_ids == hf(expected, add_special_tokens=False)["input_ids"]


def test_prompt_token_ids_pass_through(tiny_core: TokenizerCore) -> None:
    last = tiny_core.vocab_size - 1
    ids = [0, 5, last, 17, 17, 2]
    out = tiny_core.process(_req(prompt_token_ids=ids, stop_token_ids=[2, last]))
    assert out.prompt_token_ids == ids
    assert out.params.stop_token_ids == [2, last]


def test_prompt_at_the_context_limit_is_accepted(tiny_model_dir: Path) -> None:
    core = _core(tiny_model_dir, max_model_len=16)
    assert len(core.process(_req(prompt_token_ids=[7] * 15)).prompt_token_ids) == 15
    assert core.process(_req(prompt_token_ids=[7] * 10, max_tokens=6)).params.max_tokens == 6
    assert core.process(_req(prompt_token_ids=[7] * 15, max_tokens=None)).params.max_tokens is None


# ---------------------------------------------------------------- rejected requests


@pytest.mark.parametrize("fields", [
    {},
    {"prompt": "hi", "prompt_token_ids": [1, 2]},
    {"prompt": "hi", "messages": [ChatMessage("user", "hi")]},
    {"prompt_token_ids": [1], "messages": [ChatMessage("user", "hi")]},
    {"prompt": "hi", "prompt_token_ids": [1], "messages": [ChatMessage("user", "hi")]},
])
def test_exactly_one_prompt_kind(tiny_core: TokenizerCore, fields: dict[str, Any]) -> None:
    with pytest.raises(RequestError, match="exactly one of prompt, prompt_token_ids, messages"):
        tiny_core.process(_req(**fields))


@pytest.mark.parametrize("fields", [{"prompt": ""}, {"prompt_token_ids": []}])
def test_empty_prompt(tiny_core: TokenizerCore, fields: dict[str, Any]) -> None:
    with pytest.raises(RequestError, match="the prompt is empty"):
        tiny_core.process(_req(**fields))


def test_empty_messages(tiny_core: TokenizerCore) -> None:
    with pytest.raises(RequestError, match="messages is empty"):
        tiny_core.process(_req(messages=[]))


def test_unknown_role(tiny_core: TokenizerCore) -> None:
    messages = [ChatMessage("user", "hi"), ChatMessage("wizard", "abracadabra")]
    with pytest.raises(RequestError, match=r"unknown chat role 'wizard'.*system.*user.*assistant"):
        tiny_core.process(_req(messages=messages))


@pytest.mark.parametrize("offset", [0, 1, 10**9])
def test_prompt_token_ids_outside_vocab(tiny_core: TokenizerCore, offset: int) -> None:
    for bad in (tiny_core.vocab_size + offset, -offset - 1):
        with pytest.raises(RequestError, match=rf"prompt_token_ids \[{bad}\] are outside"):
            tiny_core.process(_req(prompt_token_ids=[1, bad, 3]))


@pytest.mark.parametrize("max_tokens", [0, -5])
def test_max_tokens_below_one(tiny_core: TokenizerCore, max_tokens: int) -> None:
    with pytest.raises(RequestError, match=f"max_tokens must be at least 1, got {max_tokens}"):
        tiny_core.process(_req(prompt="hi", max_tokens=max_tokens))


@pytest.mark.parametrize("temperature", [-0.5, math.nan, math.inf, -math.inf])
def test_bad_temperature(temperature: float) -> None:
    with pytest.raises(RequestError, match="temperature must be a finite number >= 0"):
        validate_params(SamplingParams(temperature=temperature), 100)


@pytest.mark.parametrize("temperature", [0.0, 0.7, 2.0])
def test_good_params_pass(temperature: float) -> None:
    validate_params(SamplingParams(max_tokens=1, temperature=temperature,
                                   stop_token_ids=[0, 99]), 100)


@pytest.mark.parametrize("stop", [[100], [5, -1], [0, 10**6]])
def test_stop_token_ids_outside_vocab(stop: list[int]) -> None:
    with pytest.raises(RequestError, match=r"stop_token_ids .* outside the vocabulary \[0, 100\)"):
        validate_params(SamplingParams(stop_token_ids=stop), 100)


def test_params_are_checked_by_process(tiny_core: TokenizerCore) -> None:
    with pytest.raises(RequestError, match="temperature"):
        tiny_core.process(_req(prompt="hi", temperature=math.nan))
    with pytest.raises(RequestError, match="stop_token_ids"):
        tiny_core.process(_req(prompt="hi", stop_token_ids=[tiny_core.vocab_size]))


def test_prompt_longer_than_context(tiny_model_dir: Path, hf_tiny: Any) -> None:
    core = _core(tiny_model_dir, max_model_len=16)
    prompt = "The quick brown fox jumps over the lazy dog. " * 4
    n = len(hf_tiny(prompt)["input_ids"])
    assert n > 16
    with pytest.raises(RequestError, match=f"the prompt has {n} tokens; this model's context "
                                           "holds 16"):
        core.process(_req(prompt=prompt))
    with pytest.raises(RequestError, match="the prompt has 16 tokens"):  # no room to output
        core.process(_req(prompt_token_ids=[7] * 16))


def test_prompt_plus_max_tokens_over_context(tiny_model_dir: Path) -> None:
    core = _core(tiny_model_dir, max_model_len=16)
    with pytest.raises(RequestError, match=r"the prompt \(10 tokens\) plus max_tokens \(7\) "
                                           "exceeds this model's context of 16 tokens"):
        core.process(_req(prompt_token_ids=[7] * 10, max_tokens=7))


# ---------------------------------------------------------------- malformed messages


class _FakeReplies:
    def __init__(self) -> None:
        self.sent: list[tuple[str, RequestOutputs]] = []

    def send(self, address: str, msg: RequestOutputs) -> bool:
        self.sent.append((address, msg))
        return True


def test_error_output_shape() -> None:
    (out,) = error_output("r9", ErrorKind.INVALID_REQUEST, "no good", "top_p").outputs
    assert (out.request_id, out.text, out.token_ids, out.finished, out.finish_reason,
            out.error, out.num_prompt_tokens, out.num_output_tokens) == (
        "r9", "", [], True, "error", "no good", 0, 0)
    assert (out.error_kind, out.error_param) == (ErrorKind.INVALID_REQUEST, "top_p")


def _protocol_error(raw: Any) -> ProtocolError:
    with pytest.raises(ProtocolError) as info:
        Codec([AddRequest]).decode(msgpack.packb(raw, use_bin_type=True))
    return info.value


def test_malformed_add_request_gets_an_error_reply() -> None:
    good = msgpack.unpackb(encode(_req(prompt="hi")), raw=False)
    bad = list(good)
    bad[3] = 42  # prompt is not a string
    exc = _protocol_error(bad)
    replies = _FakeReplies()
    _reject_malformed(replies, exc)  # type: ignore[arg-type]
    assert len(replies.sent) == 1
    address, msg = replies.sent[0]
    assert address == REPLY
    (out,) = msg.outputs
    assert (out.request_id, out.finished, out.finish_reason) == ("req-1", True, "error")
    assert out.error is not None and out.error.startswith("invalid request: ")
    assert "AddRequest.prompt" in out.error
    # the reply survives the wire
    assert Codec([RequestOutputs]).decode(encode(msg)) == msg


def test_malformed_params_get_an_error_reply() -> None:
    raw = msgpack.unpackb(encode(_req(prompt="hi", request_id="r-7")), raw=False)
    raw[6] = [5, "hot"]  # temperature is not a number
    replies = _FakeReplies()
    _reject_malformed(replies, _protocol_error(raw))  # type: ignore[arg-type]
    assert [(a, m.outputs[0].request_id) for a, m in replies.sent] == [(REPLY, "r-7")]


@pytest.mark.parametrize("raw", [
    [AddRequest.TAG, 17, REPLY, "hi"],         # request id not a string
    [AddRequest.TAG, "req-1", None, "hi"],     # no reply address
    [AddRequest.TAG, "req-1"],                 # too short to carry one
    [99, "req-1", REPLY, "hi"],                # not an AddRequest
    {"request_id": "req-1", "reply_to": REPLY},  # not a tagged array
])
def test_malformed_without_reply_address_is_dropped(raw: Any) -> None:
    replies = _FakeReplies()
    _reject_malformed(replies, _protocol_error(raw))  # type: ignore[arg-type]
    assert replies.sent == []


def test_undecodable_bytes_are_dropped() -> None:
    with pytest.raises(ProtocolError) as info:
        Codec([AddRequest]).decode(b"\xc1\xc1\xc1")
    replies = _FakeReplies()
    _reject_malformed(replies, info.value)  # type: ignore[arg-type]
    assert replies.sent == []


# ---------------------------------------------------------------- the tokenizer file, torch-free


def test_the_stage_reads_tokenizer_json_itself_and_imports_no_torch(tiny_model_dir: Path
                                                                    ) -> None:
    """A generic fast tokenizer is read with `tokenizers` (transformers' package root imports
    torch: seconds of CPU at every tokenizer start); chats and structured outputs included."""
    import subprocess
    import sys

    code = f"""
import sys
from ipc.messages import AddRequest, ChatMessage, SamplingParams, StructuredOutputs
from stages.file_tokenizer import FileTokenizer
from stages.tokenizer import TokenizerCore
core = TokenizerCore({str(tiny_model_dir)!r}, 512, 444, eos_token_ids=(2,))
assert isinstance(core.tokenizer, FileTokenizer)
chat = core.process(AddRequest("a", "r", None, None, [ChatMessage("user", "hi")],
                               SamplingParams(), 0.0))
json = core.process(AddRequest("b", "r", "x", None, None, SamplingParams(
    structured_outputs=StructuredOutputs(json='{{"type": "integer"}}')), 0.0))
assert chat.prompt_token_ids and json.grammar
print("torch" in sys.modules, "transformers.modeling_utils" in sys.modules)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, cwd=Path(__file__).resolve().parent.parent)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["False", "False"]


def test_a_model_specific_tokenizer_class_goes_through_transformers(tiny_model_dir: Path,
                                                                    tmp_path: Path) -> None:
    import json
    import shutil

    from stages.file_tokenizer import FileTokenizer, load_tokenizer

    folder = tmp_path / "gpt2-class"
    shutil.copytree(tiny_model_dir, folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["tokenizer_class"] = "GPT2Tokenizer"  # may rebuild the backend: not ours to read
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    tok = load_tokenizer(str(folder))
    assert not isinstance(tok, FileTokenizer)
    assert tok(PROMPT)["input_ids"] == AutoTokenizer.from_pretrained(folder)(PROMPT)["input_ids"]
    assert isinstance(load_tokenizer(str(tiny_model_dir)), FileTokenizer)


def test_added_tokens_of_the_config_and_named_templates_are_kept(tiny_model_dir: Path,
                                                                 tmp_path: Path) -> None:
    """tokenizer_config.json may list added tokens tokenizer.json lacks, and give named chat
    templates (transformers picks "tool_use" when there are tools)."""
    import json
    import shutil

    from stages.file_tokenizer import load_tokenizer

    folder = tmp_path / "added"
    shutil.copytree(tiny_model_dir, folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.setdefault("added_tokens_decoder", {})["444"] = {
        "content": "<tool_call>", "special": True, "lstrip": False, "rstrip": False,
        "normalized": False, "single_word": False}
    config["chat_template"] = [
        {"name": "default", "template": "{% for m in messages %}[{{ m.content }}]{% endfor %}"},
        {"name": "tool_use", "template": "{{ tools | length }} tool(s){{ eos_token }}"}]
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    (folder / "chat_template.jinja").unlink()  # (a template file would take priority)
    ours, hf = load_tokenizer(str(folder)), AutoTokenizer.from_pretrained(folder)
    text = "call <tool_call> now"
    assert ours(text)["input_ids"] == hf(text)["input_ids"]
    assert ours(text)["input_ids"].count(444) == 1
    chat = [{"role": "user", "content": "hi"}]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    for kw in ({}, {"tools": tools}):
        assert ours.apply_chat_template(chat, tokenize=False, **kw) == \
            hf.apply_chat_template(chat, tokenize=False, **kw)
    assert ours.apply_chat_template(chat, tools=tools) == "1 tool(s)<|im_end|>"


@pytest.mark.parametrize("model", ["tiny", "default"])
@pytest.mark.parametrize("clean_up", ["off", "on (ignored for BPE)", "forced"])
def test_decode_is_transformers_decode(request: pytest.FixtureRequest, model: str,
                                       clean_up: str, tmp_path: Path) -> None:
    import json
    import shutil

    from stages.file_tokenizer import FileTokenizer, load_tokenizer

    folder = tmp_path / model
    shutil.copytree(request.getfixturevalue(f"{model}_model_dir"), folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["clean_up_tokenization_spaces"] = clean_up != "off"
    config["clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output"] = \
        clean_up == "forced"
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    ours, hf = load_tokenizer(str(folder)), AutoTokenizer.from_pretrained(folder)
    assert isinstance(ours, FileTokenizer)
    text = "<|im_start|>user\nIt 's done , isn't it ? " + PROMPT + "<|im_end|>"
    ids = hf(text)["input_ids"]
    for skip in (False, True):
        assert ours.decode(ids, skip_special_tokens=skip) == \
            hf.decode(ids, skip_special_tokens=skip)
