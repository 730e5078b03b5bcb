"""Tests for stages.detokenizer.Detokenizer: streamed deltas add up to a full decode, routing
by reply address, per-request state and the O(N) cost of incremental detokenization."""

from __future__ import annotations

import random
from operator import attrgetter
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer, decoders

from ipc.messages import (
    DetokBatch,
    DetokRequestInfo,
    RequestOutput,
    TokenColumns,
    TokenDelta,
)
from stages.detokenizer import Detokenizer

REPLACEMENT = "\ufffd"
TEXTS = [
    "日本語のテキスト。中文文本，한국어 텍스트입니다.",
    "Emoji: 🚀🔥✨ family 👩\u200d👩\u200d👧 flags 🇯🇵🇫🇷 skin 👍🏽",
    "Héllo wörld, ça va? Grüße aus Köln, naïve façade, Ærøskøbing, Łódź.",
    "Combining: e\u0301 a\u0308 n\u0303 o\u0302\u0323 Vie\u0323\u0302t Nam, "
    "Z\u0336a\u0336l\u0336g\u0336o\u0336",
    "Mixed: The quick 狐 jumps 🦊 over the lazy 犬 — «ça» ✓ ∑ x² ≠ ∞ 😀",
]
ADDRESSES = ["ipc:///tmp/client-a", "ipc:///tmp/client-b"]


@pytest.fixture(params=["tiny", "default"])
def tokenizer_json(request: pytest.FixtureRequest) -> Path:
    folder: Path = request.getfixturevalue(f"{request.param}_model_dir")
    return folder / "tokenizer.json"


@pytest.fixture
def tokenizer(tokenizer_json: Path) -> Tokenizer:
    return Tokenizer.from_file(str(tokenizer_json))


@pytest.fixture
def tiny_tokenizer(tiny_model_dir: Path) -> Tokenizer:
    return Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))


def _info(request_id: str, reply_to: str = ADDRESSES[0], *, skip: bool = True,
          num_prompt_tokens: int = 7) -> DetokRequestInfo:
    return DetokRequestInfo(request_id, reply_to, num_prompt_tokens, skip, 0.0)


def _chunks(ids: list[int], mode: str, seed: int = 0) -> list[list[int]]:
    if mode == "one":
        return [[t] for t in ids]
    if mode == "all":
        return [list(ids)]
    rng, out, i = random.Random(seed), [], 0
    while i < len(ids):
        n = rng.randint(1, 5)
        out.append(ids[i:i + n])
        i += n
    return out


def _stream(detok: Detokenizer, ids: list[int], mode: str, *, skip: bool = True,
            finish_reason: str = "length", request_id: str = "r0",
            seed: int = 0) -> list[RequestOutput]:
    """Feeds ids as one request in chunks (one DetokBatch each); returns its outputs in order."""
    chunks = _chunks(ids, mode, seed)
    outputs: list[RequestOutput] = []
    for i, chunk in enumerate(chunks):
        last = i == len(chunks) - 1
        new = [_info(request_id, skip=skip)] if i == 0 else []
        batch = DetokBatch(new, [TokenDelta(request_id, chunk, finish_reason if last else None)])
        result = detok.feed(batch)
        assert list(result) == [ADDRESSES[0]]
        assert [o.request_id for o in result[ADDRESSES[0]]] == [request_id]
        outputs.extend(result[ADDRESSES[0]])
    return outputs


def test_multibyte_text_is_split_across_tokens(tiny_tokenizer: Tokenizer) -> None:
    """Sanity check of the fixture: the hard case (a character cut between tokens) occurs."""
    for text in TEXTS[:2]:
        ids = tiny_tokenizer.encode(text, add_special_tokens=False).ids
        assert any(REPLACEMENT in tiny_tokenizer.decode([t]) for t in ids)


@pytest.mark.parametrize("mode", ["one", "random", "all"])
@pytest.mark.parametrize("text", TEXTS)
def test_deltas_add_up_to_full_decode(tokenizer: Tokenizer, text: str, mode: str) -> None:
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    full = tokenizer.decode(ids, skip_special_tokens=True)
    assert full == text  # byte-level BPE round-trips
    outputs = _stream(Detokenizer(tokenizer), ids, mode, seed=len(text))
    assert "".join(o.text for o in outputs) == full
    assert all(REPLACEMENT not in o.text for o in outputs)
    assert [t for o in outputs for t in o.token_ids] == ids
    assert [o.finished for o in outputs] == [False] * (len(outputs) - 1) + [True]


@pytest.mark.parametrize("seed", range(5))
def test_random_chunks_never_emit_half_characters(tokenizer: Tokenizer, seed: int) -> None:
    text = " ".join(random.Random(seed).sample(TEXTS, len(TEXTS)))
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    detok = Detokenizer(tokenizer)
    outputs = _stream(detok, ids, "random", seed=seed)
    emitted = ""
    for o in outputs:  # every prefix of the stream is a prefix of the text: no char is emitted
        emitted += o.text  # before it is complete, nor changed afterwards
        assert text.startswith(emitted)
        assert REPLACEMENT not in o.text
    assert emitted == text


@pytest.mark.parametrize("mode", ["one", "random", "all"])
def test_random_token_ids_match_full_decode(tiny_tokenizer: Tokenizer, mode: str) -> None:
    """Arbitrary ids (as a random model emits: lone bytes, invalid UTF-8, a cut-off character
    at the end) still stream exactly decode(all ids), U+FFFD included where decode has it."""
    vocab = tiny_tokenizer.get_vocab_size()
    for seed in range(40):
        rng = random.Random(seed)
        ids = [rng.randrange(vocab) for _ in range(rng.randint(1, 40))]
        outputs = _stream(Detokenizer(tiny_tokenizer), ids, mode, seed=seed)
        assert "".join(o.text for o in outputs) == tiny_tokenizer.decode(ids), seed


def test_output_cut_mid_character_is_flushed_on_finish(tokenizer: Tokenizer) -> None:
    """A request stopped (max_tokens) inside a multi-byte character ends with U+FFFD, like
    decode(all ids); the held-back bytes are not silently dropped."""
    ids = tokenizer.encode("日本語 🚀🔥✨", add_special_tokens=False).ids
    cuts = [n for n in range(1, len(ids)) if tokenizer.decode(ids[:n]).endswith(REPLACEMENT)]
    if not cuts:
        pytest.skip("this tokenizer has no token boundary inside these characters")
    for n in cuts:
        for mode in ("one", "all"):
            outputs = _stream(Detokenizer(tokenizer), ids[:n], mode)
            assert "".join(o.text for o in outputs) == tokenizer.decode(ids[:n])
            assert outputs[-1].text.endswith(REPLACEMENT)
            assert all(REPLACEMENT not in o.text for o in outputs[:-1])


@pytest.mark.parametrize("mode", ["one", "random", "all"])
@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens_skipped_or_kept(tokenizer: Tokenizer, skip: bool, mode: str) -> None:
    text = "<|im_start|>assistant\n日本語 and 🚀 ça<|im_end|>\n<|im_start|>x<|im_end|>"
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    im_end = tokenizer.token_to_id("<|im_end|>")
    assert im_end is not None and im_end in ids
    outputs = _stream(Detokenizer(tokenizer), ids, mode, skip=skip)
    streamed = "".join(o.text for o in outputs)
    assert streamed == tokenizer.decode(ids, skip_special_tokens=skip)
    if skip:
        assert "<|im_end|>" not in streamed and "<|im_start|>" not in streamed
        assert "日本語 and 🚀 ça" in streamed
    else:
        assert streamed == text
        assert streamed.count("<|im_end|>") == 2


def test_eos_as_last_token(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("Köln 🚀", add_special_tokens=False).ids
    ids.append(tokenizer.token_to_id("<|im_end|>"))
    kept = _stream(Detokenizer(tokenizer), ids, "one", skip=False, finish_reason="stop")
    dropped = _stream(Detokenizer(tokenizer), ids, "one", skip=True, finish_reason="stop")
    assert "".join(o.text for o in kept) == "Köln 🚀<|im_end|>"
    assert "".join(o.text for o in dropped) == "Köln 🚀"
    assert dropped[-1].finished and dropped[-1].finish_reason == "stop"


def test_interleaved_requests_are_routed_to_their_address(tokenizer: Tokenizer) -> None:
    reply = {"a": ADDRESSES[0], "b": ADDRESSES[1], "c": ADDRESSES[0]}
    ids = {rid: tokenizer.encode(TEXTS[i], add_special_tokens=False).ids
           for i, rid in enumerate(reply)}
    pos = {rid: 0 for rid in reply}
    texts: dict[str, str] = {rid: "" for rid in reply}
    counts: dict[str, int] = {rid: 0 for rid in reply}
    detok, rng, announced = Detokenizer(tokenizer), random.Random(1), set()
    while any(pos[r] < len(ids[r]) for r in reply):
        live = [r for r in reply if pos[r] < len(ids[r])]
        rng.shuffle(live)
        step = live[:rng.randint(1, len(live))]
        new = [_info(r, reply[r], num_prompt_tokens=10 + i)
               for i, r in enumerate(reply) if r in step and r not in announced]
        announced.update(step)
        deltas = []
        for r in step:
            n = rng.randint(1, 3)
            chunk = ids[r][pos[r]:pos[r] + n]
            pos[r] += len(chunk)
            deltas.append(TokenDelta(r, chunk, "stop" if pos[r] == len(ids[r]) else None))
        result = detok.feed(DetokBatch(new, deltas))
        assert set(result) == {reply[r] for r in step}
        for address, outputs in result.items():
            assert [o.request_id for o in outputs] == [r for r in step if reply[r] == address]
            for o in outputs:
                assert o.token_ids == next(d.token_ids for d in deltas if d.request_id
                                           == o.request_id)
                counts[o.request_id] += len(o.token_ids)
                assert o.num_output_tokens == counts[o.request_id]
                assert o.num_prompt_tokens == 10 + list(reply).index(o.request_id)
                assert o.finished == (pos[o.request_id] == len(ids[o.request_id]))
                texts[o.request_id] += o.text
    assert texts == {r: tokenizer.decode(ids[r]) for r in reply}
    assert detok.requests == {}


def test_num_output_tokens_is_cumulative(tiny_tokenizer: Tokenizer) -> None:
    detok = Detokenizer(tiny_tokenizer)
    ids = tiny_tokenizer.encode("The quick brown fox jumps", add_special_tokens=False).ids
    assert len(ids) >= 4
    first = detok.feed(DetokBatch([_info("r", num_prompt_tokens=3)],
                                  [TokenDelta("r", ids[:1])]))[ADDRESSES[0]][0]
    second = detok.feed(DetokBatch([], [TokenDelta("r", ids[1:3])]))[ADDRESSES[0]][0]
    third = detok.feed(DetokBatch([], [TokenDelta("r", ids[3:], "length")]))[ADDRESSES[0]][0]
    assert [first.num_output_tokens, second.num_output_tokens, third.num_output_tokens] == [
        1, 3, len(ids)]
    assert {first.num_prompt_tokens, second.num_prompt_tokens, third.num_prompt_tokens} == {3}


def test_finish_removes_state_and_carries_reason(tiny_tokenizer: Tokenizer) -> None:
    detok = Detokenizer(tiny_tokenizer)
    ids = tiny_tokenizer.encode("Grüße 日本", add_special_tokens=False).ids
    detok.feed(DetokBatch([_info("ok"), _info("bad", ADDRESSES[1]), _info("ab")],
                          [TokenDelta("ok", ids[:2]), TokenDelta("bad", ids[:1])]))
    assert set(detok.requests) == {"ok", "bad", "ab"}
    result = detok.feed(DetokBatch([], [
        TokenDelta("bad", [], "error", "executor failed: out of memory"),
        TokenDelta("ab", [], "abort"),
    ]))
    (bad,) = result[ADDRESSES[1]]
    assert (bad.finished, bad.finish_reason, bad.error) == (
        True, "error", "executor failed: out of memory")
    assert (bad.token_ids, bad.num_output_tokens) == ([], 1)
    (ab,) = result[ADDRESSES[0]]
    assert (ab.request_id, ab.finished, ab.finish_reason, ab.error) == ("ab", True, "abort", None)
    assert set(detok.requests) == {"ok"}
    result = detok.feed(DetokBatch([], [TokenDelta("ok", ids[2:], "stop")]))
    (ok,) = result[ADDRESSES[0]]
    assert (ok.finished, ok.finish_reason, ok.error) == (True, "stop", None)
    assert detok.requests == {}
    # a late delta for a finished request is dropped, not resurrected
    assert detok.feed(DetokBatch([], [TokenDelta("ok", ids[:1])])) == {}
    assert detok.requests == {}


def test_many_requests_leave_no_state(tiny_tokenizer: Tokenizer) -> None:
    detok = Detokenizer(tiny_tokenizer)
    ids = tiny_tokenizer.encode("Emoji: 🚀🔥✨", add_special_tokens=False).ids
    for i in range(200):
        # a cut-off character is held back at finish: its state must go too
        detok.feed(DetokBatch([_info(f"r{i}")], [TokenDelta(f"r{i}", ids[:i % len(ids) + 1])]))
        detok.feed(DetokBatch([], [TokenDelta(f"r{i}", [], "length")]))
    assert detok.requests == {}


def test_unknown_request_is_ignored(tiny_tokenizer: Tokenizer) -> None:
    detok = Detokenizer(tiny_tokenizer)
    ids = tiny_tokenizer.encode("Köln", add_special_tokens=False).ids
    assert detok.feed(DetokBatch([], [TokenDelta("ghost", ids, "stop")])) == {}
    result = detok.feed(DetokBatch([_info("real")], [
        TokenDelta("ghost", ids), TokenDelta("real", ids, "stop"),
        TokenDelta("ghost2", [], "error", "x")]))
    assert [(o.request_id, o.text) for o in result[ADDRESSES[0]]] == [("real", "Köln")]
    assert detok.requests == {}


class _CountingDecoder:
    """Wraps a tokenizer's decoder to record how many tokens each decode works on; it sees
    the decodes done inside DecodeStream (Rust) as well as those made from Python."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.sizes: list[int] = []

    def decode_chain(self, tokens: list[str]) -> list[str]:
        self.sizes.append(len(tokens))
        return [self.inner.decode(tokens)]


@pytest.mark.parametrize("mode", ["one", "random"])
def test_decoding_n_tokens_costs_o_n(tokenizer_json: Path, mode: str) -> None:
    tokenizer = Tokenizer.from_file(str(tokenizer_json))
    reference = Tokenizer.from_file(str(tokenizer_json))
    counter = _CountingDecoder(tokenizer.decoder)
    tokenizer.decoder = decoders.Decoder.custom(counter)
    ids = tokenizer.encode(" ".join(TEXTS) * 10, add_special_tokens=False).ids
    n = len(ids)
    assert n > 500
    outputs = _stream(Detokenizer(tokenizer), ids, mode)
    # re-decoding a growing prefix would touch about n*n/2 tokens; a window touches O(n)
    assert counter.sizes and max(counter.sizes) <= 16
    assert sum(counter.sizes) <= 8 * n
    assert "".join(o.text for o in outputs) == reference.decode(ids)


def test_rejected_request_is_answered_without_touching_a_live_one(tiny_tokenizer: Tokenizer
                                                                   ) -> None:
    """A duplicate id is rejected by the scheduler: its error goes to the duplicate's sender;
    the live request of that id keeps streaming to its own client."""
    from ipc.messages import RequestRejected

    detok = Detokenizer(tiny_tokenizer)
    detok.feed(DetokBatch([_info("dup", ADDRESSES[0])], []))
    out = detok.feed(DetokBatch([], [], [RequestRejected("dup", ADDRESSES[1], "error",
                                                         "request id 'dup' is already in use", 4)]))
    assert list(out) == [ADDRESSES[1]]
    (rej,) = out[ADDRESSES[1]]
    assert rej.finished and rej.finish_reason == "error" and "in use" in (rej.error or "")
    out = detok.feed(DetokBatch([], [TokenDelta("dup", [5, 6], "length")]))
    assert list(out) == [ADDRESSES[0]] and out[ADDRESSES[0]][0].token_ids == [5, 6]
    assert detok.requests == {}


@pytest.mark.parametrize("seed", range(4))
def test_steady_deltas_as_columns_give_the_outputs_of_token_deltas(
        tiny_tokenizer: Tokenizer, seed: int) -> None:
    """A batch's steady deltas (TokenColumns) against the same as TokenDeltas, step by
    step: the same outputs, in each sample's order, to the same address, with and without
    stop strings, n = 2, a cached prompt, an id the tokenizer cannot decode (that sample's error),
    a request the worker does not know, and finishing deltas beside them (-1: an id no
    tokenizer decodes)."""
    rng = random.Random(seed)
    vocab = tiny_tokenizer.get_vocab_size()
    infos = [_info("plain"), DetokRequestInfo("two", ADDRESSES[1], 5, True, 0.0, n=2),
             DetokRequestInfo("stops", ADDRESSES[0], 3, True, 0.0, stop=["a", "e "])]
    samples = [("plain", 0), ("two", 0), ("two", 1), ("stops", 0), ("ghost", 0)]
    columns, whole = Detokenizer(tiny_tokenizer), Detokenizer(tiny_tokenizer)
    got: dict[str, list[RequestOutput]] = {}
    expected: dict[str, list[RequestOutput]] = {}
    for step in range(40):
        plain, deltas = TokenColumns(), []
        for rid, index in samples:
            bad = (rid, step) == ("plain", 30)
            token = -1 if bad else rng.randrange(vocab)
            if step == 39 or (rng.random() < 0.1 and not bad):
                deltas.append(TokenDelta(rid, [token, rng.randrange(vocab)],
                                         "length" if step == 39 else None, index=index))
            else:
                plain.append(rid, token, index, 4 if rid == "two" else 0)
        new = infos if step == 0 else []
        for address, outs in columns.feed(DetokBatch(new, deltas, plain=plain)).items():
            got.setdefault(address, []).extend(outs)
        everything = DetokBatch(new, deltas + plain.deltas())
        for address, outs in whole.feed(everything).items():
            expected.setdefault(address, []).extend(outs)
    key = attrgetter("request_id", "index")
    assert {a: sorted(o, key=key) for a, o in got.items()} == {
        a: sorted(o, key=key) for a, o in expected.items()}
    assert any(o.error for o in got[ADDRESSES[0]])  # (the sample fed -1)
    assert not columns.requests and not whole.requests


def test_steady_outputs_go_to_each_client_as_columns(tiny_tokenizer: Tokenizer) -> None:
    """feed_messages: a steady delta's output, of a sample without stop strings, is a row of
    its client's columns; a finishing one, or one with stop strings, a RequestOutput."""
    detok = Detokenizer(tiny_tokenizer)
    detok.feed(DetokBatch([_info("a"), _info("b", ADDRESSES[1]), _info("f", ADDRESSES[1]),
                           DetokRequestInfo("s", ADDRESSES[1], 3, True, 0.0, stop=["zz"])], []))
    plain = TokenColumns(["a", "b", "s"], [40, 41, 42], [0, 0, 0], [0, 8, 0])
    msgs = detok.feed_messages(DetokBatch([], [TokenDelta("f", [43], "length")], plain=plain))
    assert msgs[ADDRESSES[0]].plain.request_ids == ["a"] and not msgs[ADDRESSES[0]].outputs
    second = msgs[ADDRESSES[1]]
    assert second.plain.request_ids == ["b"] and second.plain.num_cached_tokens == [8]
    assert [(o.request_id, o.finished) for o in second.outputs] == [("f", True), ("s", False)]
    (a,) = msgs[ADDRESSES[0]].all_outputs()
    assert (a.token_ids, a.num_output_tokens, a.text) == ([40], 1, tiny_tokenizer.decode([40]))
