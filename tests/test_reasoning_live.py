"""A thinking model through `run_pipeline serve --reasoning-parser qwen3`, with the official
`openai` package and LangChain: a tiny random Qwen3 whose tokenizer has `<think>`/`</think>`
as added (not special) tokens and a chat template that thinks like Qwen3's; logit_bias makes
its tags likely, so its seeded answers think and then answer. Each choice is checked against
the same sample's raw text (a completion of the same prompt ids, same seed): the thinking is
in reasoning_content (and reasoning), none of it in content, streamed and not."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from test_server import Server, serve

from pipeline.server.reasoning import Qwen3Parser

pytestmark = [pytest.mark.live, pytest.mark.timeout(300)]

# Qwen3's shape: enable_thinking=False closes an empty block; open_think (ours) opens one in
# the prompt, as templates of thinking-only models do.
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{% elif open_think is defined and open_think %}<think>\n{% endif %}{% endif %}")
MESSAGES = [{"role": "user", "content": "What is two and two?"}]
N = 8


def build_thinking_qwen3(folder: Path) -> Path:
    from tokenizers import AddedToken

    from pipeline.tools.random_model import build_random_llama, build_tokenizer

    tok = build_tokenizer(folder / "tok")
    tok.add_tokens([AddedToken("<think>", special=False, normalized=False),
                    AddedToken("</think>", special=False, normalized=False)])
    tok.chat_template = TEMPLATE
    tok.save_pretrained(folder / "tok")
    return build_random_llama(folder / "qwen3-thinking", arch="qwen3", max_len=1024,
                              tokenizer_from=folder / "tok")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    model = build_thinking_qwen3(tmp_path_factory.mktemp("thinking"))
    with serve(model, "--reasoning-parser", "qwen3") as s:
        yield s


@pytest.fixture(scope="module")
def tokenizer(server: Server) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(server.model_dir)


def client(server: Server):  # type: ignore[no-untyped-def]
    import openai

    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0,
                         timeout=60)


def raw_samples(server: Server, tokenizer: Any, kwargs: dict[str, Any],
                sampling: dict[str, Any]) -> list[Any]:
    """The same samples as the chat's, as a completion of the same prompt ids: their text as
    the model wrote it, tags included."""
    prompt = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True,
                                           tokenize=False, **kwargs)
    ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    r = client(server).completions.create(model=server.model, prompt=ids, logprobs=0,
                                          **sampling)
    return sorted(r.choices, key=lambda c: c.index)


def sampling_with_tags(tokenizer: Any) -> dict[str, Any]:
    bias = {str(tokenizer.convert_tokens_to_ids(t)): b for t, b in (("<think>", 6),
                                                                    ("</think>", 7))}
    return {"max_tokens": 24, "temperature": 1.0, "seed": 11, "n": N, "logit_bias": bias}


@pytest.mark.parametrize("kwargs", [{}, {"open_think": True}], ids=["model-opens", "prompt-opens"])
def test_the_thinking_reaches_the_sdk_in_reasoning_content_not_content(
        server: Server, tokenizer: Any, kwargs: dict[str, Any]) -> None:
    sampling = sampling_with_tags(tokenizer)
    raws = raw_samples(server, tokenizer, kwargs, sampling)
    extra = {"chat_template_kwargs": kwargs} if kwargs else None
    chat = client(server).chat.completions.create(
        model=server.model, messages=MESSAGES, extra_body=extra, **sampling)
    stream = client(server).chat.completions.create(
        model=server.model, messages=MESSAGES, extra_body=extra, stream=True,
        stream_options={"include_usage": True}, **sampling)
    streamed: dict[int, list[str]] = {i: ["", "", ""] for i in range(N)}
    usage = None
    for chunk in stream:
        usage = chunk.usage or usage
        for c in chunk.choices:
            got = streamed[c.index]
            r = (c.delta.model_extra or {}).get("reasoning_content")
            assert r == (c.delta.model_extra or {}).get("reasoning")
            got[0] += r or ""
            got[1] += c.delta.content or ""
            got[2] += "R" if r else ("C" if c.delta.content else "")
    thought_and_answered = 0
    for raw, choice in zip(raws, sorted(chat.choices, key=lambda c: c.index), strict=True):
        expected = Qwen3Parser(bool(kwargs)).split(raw.text)
        message = choice.message
        reasoning = message.model_extra["reasoning_content"]
        assert message.model_extra["reasoning"] == reasoning
        assert (reasoning or "", message.content or "") == expected, raw.text
        assert "<think>" not in (message.content or "") or "<think>" in expected.content
        s_reasoning, s_content, order = streamed[choice.index]
        assert (s_reasoning, s_content) == expected
        assert "CR" not in order  # the reasoning deltas come before the content's
        if "</think>" in raw.text and expected.reasoning and expected.content:
            thought_and_answered += 1
    assert thought_and_answered >= 2, [r.text for r in raws]  # the path ran, twice at least
    # usage: max_tokens counts both (every choice ran to it); the reasoning's tokens are
    # those up to </think>, included
    assert chat.usage.completion_tokens == N * sampling["max_tokens"]
    reasoning_tokens = 0
    for raw in raws:
        parser, tokens = Qwen3Parser(bool(kwargs)), raw.logprobs.tokens  # as sampled
        parser.split(raw.text)
        if parser.entered:
            reasoning_tokens += tokens.index("</think>") + 1 if parser.ended else len(tokens)
    details = chat.usage.completion_tokens_details
    assert details is not None and details.reasoning_tokens == reasoning_tokens
    assert usage is not None and usage.completion_tokens_details.reasoning_tokens \
        == reasoning_tokens


def test_enable_thinking_false_gives_content_only(server: Server, tokenizer: Any) -> None:
    sampling = {"max_tokens": 12, "temperature": 1.0, "seed": 5, "n": 2}
    kwargs = {"enable_thinking": False}
    raws = raw_samples(server, tokenizer, kwargs, sampling)
    chat = client(server).chat.completions.create(
        model=server.model, messages=MESSAGES, extra_body={"chat_template_kwargs": kwargs},
        **sampling)
    for raw, choice in zip(raws, sorted(chat.choices, key=lambda c: c.index), strict=True):
        assert not raw.text.lstrip().startswith("<think>")
        assert choice.message.content == raw.text
        assert choice.message.model_extra["reasoning_content"] is None
    assert chat.usage.completion_tokens_details.reasoning_tokens == 0
    # /tokenize renders the same prompt
    import httpx

    r = httpx.post(f"{server.url}/tokenize", timeout=30, json={
        "messages": MESSAGES, "chat_template_kwargs": kwargs}).json()
    assert tokenizer.decode(r["tokens"]).endswith("<think>\n\n</think>\n\n")


def test_langchain_gets_a_clean_content(server: Server, tokenizer: Any) -> None:
    from langchain_openai import ChatOpenAI

    sampling = sampling_with_tags(tokenizer)
    raws = raw_samples(server, tokenizer, {}, {**sampling, "n": 1})
    llm = ChatOpenAI(base_url=f"{server.url}/v1", api_key="none", model=server.model,
                     max_tokens=24, temperature=1.0, seed=11,
                     logit_bias={int(k): v for k, v in sampling["logit_bias"].items()})
    answer = llm.invoke(MESSAGES[0]["content"])
    expected = Qwen3Parser().split(raws[0].text)
    assert expected.reasoning and expected.content  # (this seed's sample thinks, then answers)
    assert answer.content == expected.content


def test_bad_chat_template_kwargs_are_a_400_naming_them(server: Server) -> None:
    import httpx

    for value, words in (([1], "must be an object"), ({"tools": []}, "may not set")):
        r = httpx.post(f"{server.url}/v1/chat/completions", timeout=30, json={
            "messages": MESSAGES, "chat_template_kwargs": value})
        error = r.json()["error"]
        assert r.status_code == 400 and error["param"] == "chat_template_kwargs", error
        assert words in error["message"], error


def test_a_format_constrains_the_answer_after_the_thinking_not_the_thinking(
        server: Server, tokenizer: Any) -> None:
    """guided_regex with a thinking template: the thinking is free text (tags and all), the
    answer after </think> is exactly the format."""
    import re

    end = str(tokenizer.convert_tokens_to_ids("</think>"))
    chat = client(server).chat.completions.create(
        model=server.model, messages=MESSAGES, max_tokens=40, temperature=1.0, seed=3, n=4,
        logit_bias={end: 3}, extra_body={"chat_template_kwargs": {"open_think": True},
                                         "guided_regex": "[0-9]{3}"})
    answered = 0
    for choice in chat.choices:
        thinking = choice.message.model_extra["reasoning_content"]
        assert thinking is not None
        if choice.finish_reason == "stop":
            assert re.fullmatch("[0-9]{3}", choice.message.content or ""), choice.message
            answered += 1
    assert answered >= 2 and any(re.search("[^0-9]", c.message.model_extra[
        "reasoning_content"]) for c in chat.choices)  # the thinking was not held to digits
