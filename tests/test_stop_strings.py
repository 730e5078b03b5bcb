"""Stop strings in the detokenizer: found across token boundaries and inside multi-byte text,
cut from the output unless asked for, never streamed in part (held back while they could still
match), reported with the matching string, and the scheduler told at once."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from ipc.messages import DetokBatch, DetokRequestInfo, RequestOutput, StopSample, TokenDelta
from stages.detokenizer import Detokenizer, find_stop, hold_back

CLIENT = "ipc:///tmp/client"


@pytest.fixture(params=["tiny", "default"])
def tokenizer(request: pytest.FixtureRequest) -> Tokenizer:
    folder: Path = request.getfixturevalue(f"{request.param}_model_dir")
    return Tokenizer.from_file(str(folder / "tokenizer.json"))


def info(stop: list[str], *, include: bool = False, min_tokens: int = 0, n: int = 1,
         rid: str = "r") -> DetokRequestInfo:
    return DetokRequestInfo(rid, CLIENT, 3, True, 0.0, n, stop, include, min_tokens)


def stream(detok: Detokenizer, ids: list[int], req: DetokRequestInfo, chunk: int = 1,
           finish_reason: str = "length") -> list[RequestOutput]:
    """Feed ids `chunk` at a time, as the scheduler would; stop feeding once the detokenizer
    has finished the sample, then send the scheduler's own final delta (ignored)."""
    outs: list[RequestOutput] = []
    pieces = [ids[i:i + chunk] for i in range(0, len(ids), chunk)]
    for i, piece in enumerate(pieces):
        last = i == len(pieces) - 1
        batch = DetokBatch([req] if i == 0 else [],
                           [TokenDelta(req.request_id, piece, finish_reason if last else None)])
        outs += detok.feed(batch).get(CLIENT, [])
        if outs and outs[-1].finished:
            if not last:  # the scheduler's last delta, after it processed the stop
                assert detok.feed(DetokBatch([], [TokenDelta(req.request_id, [], "stop")])) == {}
            break
    assert req.request_id not in detok.requests
    return outs


def test_hold_back_and_find_stop() -> None:
    assert hold_back("hello wor", ["world"]) == 3
    assert hold_back("hello", ["world", "lo!"]) == 2
    assert hold_back("abc", ["x"]) == 0
    assert hold_back("ab", ["abc"]) == 2
    assert find_stop("one STOP two END", 0, ["END", "STOP"]) == (4, "STOP")
    assert find_stop("one STOP", 5, ["STOP"]) is None


@pytest.mark.parametrize("chunk", [1, 3])
def test_a_stop_string_split_across_tokens_is_cut(tokenizer: Tokenizer, chunk: int) -> None:
    text = "The answer is forty-two. END of the story, and more words after it."
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    detok = Detokenizer(tokenizer)
    outs = stream(detok, ids, info(["D of"]), chunk)
    assert "".join(o.text for o in outs) == "The answer is forty-two. EN"
    last = outs[-1]
    assert last.finished and last.finish_reason == "stop" and last.stop_reason == "D of"
    assert detok.stopped == [StopSample("r", 0)]
    # token ids end with the token that completed the stop string; nothing after it
    out_ids = [t for o in outs for t in o.token_ids]
    assert out_ids == ids[:len(out_ids)]
    assert "D of" in tokenizer.decode(out_ids) and "D of" not in tokenizer.decode(out_ids[:-1])


def test_include_stop_str_in_output(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("alpha beta gamma delta", add_special_tokens=False).ids
    outs = stream(Detokenizer(tokenizer), ids, info(["gamma"], include=True))
    assert "".join(o.text for o in outs) == "alpha beta gamma"


def test_stop_strings_in_multibyte_text(tokenizer: Tokenizer) -> None:
    text = "日本語のテキスト。中文文本🚀🔥 then ascii"
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    for stop, before in [("テキ", "日本語の"), ("🔥", "日本語のテキスト。中文文本🚀"),
                         ("。中", "日本語のテキスト")]:
        outs = stream(Detokenizer(tokenizer), ids, info([stop]))
        assert "".join(o.text for o in outs) == before, stop
        assert outs[-1].stop_reason == stop


def test_streaming_never_shows_part_of_a_stop_string(tokenizer: Tokenizer) -> None:
    """At every delta, the text streamed so far is a prefix of the final text and ends with
    no prefix of the stop string that would later turn out to be part of it."""
    rng = random.Random(0)
    words = ["stop", "sto", "st", "s", "top", "alpha", "STOP", "🚀", "é"]
    for trial in range(30):
        text = " ".join(rng.choice(words) for _ in range(12)) + " STOP! tail"
        ids = tokenizer.encode(text, add_special_tokens=False).ids
        outs = stream(Detokenizer(tokenizer), ids, info(["STOP!"]), rng.randint(1, 3))
        final = text[:text.index("STOP!")]
        shown = ""
        for o in outs:
            shown += o.text
            assert final.startswith(shown), (trial, shown)
        assert shown == final and outs[-1].stop_reason == "STOP!"


def test_text_that_only_looked_like_a_stop_is_released(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("wait, wai wa done", add_special_tokens=False).ids
    outs = stream(Detokenizer(tokenizer), ids, info(["wait!"]))
    assert "".join(o.text for o in outs) == "wait, wai wa done"
    assert outs[-1].finish_reason == "length" and outs[-1].stop_reason is None


def test_the_earliest_of_several_stops_wins(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("one two three four", add_special_tokens=False).ids
    outs = stream(Detokenizer(tokenizer), ids, info(["four", "two", "three"]), chunk=10)
    assert "".join(o.text for o in outs) == "one " and outs[-1].stop_reason == "two"


def test_stops_count_only_after_min_tokens(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("x x x x x x x x", add_special_tokens=False).ids
    first_x_tokens = len(tokenizer.encode("x x x", add_special_tokens=False).ids)
    outs = stream(Detokenizer(tokenizer), ids, info(["x"], min_tokens=first_x_tokens))
    text = "".join(o.text for o in outs)
    assert text.startswith("x x x") and outs[-1].stop_reason == "x"


def test_samples_stop_independently(tokenizer: Tokenizer) -> None:
    detok = Detokenizer(tokenizer)
    a = tokenizer.encode("red green blue", add_special_tokens=False).ids
    b = tokenizer.encode("cyan magenta", add_special_tokens=False).ids
    out = detok.feed(DetokBatch([info(["green"], n=2)], [TokenDelta("r", a, None, None, 0),
                                                         TokenDelta("r", b, None, None, 1)]))
    s0, s1 = out[CLIENT]
    assert (s0.index, s0.text, s0.finished, s0.stop_reason) == (0, "red ", True, "green")
    assert (s1.index, s1.finished) == (1, False) and "cyan" in s1.text
    assert detok.stopped == [StopSample("r", 0)]
    detok.feed(DetokBatch([], [TokenDelta("r", [], "stop", None, 0)]))
    assert "r" in detok.requests  # sample 1 still runs
    out = detok.feed(DetokBatch([], [TokenDelta("r", [], "length", None, 1)]))
    assert out[CLIENT][0].finished and "r" not in detok.requests


@pytest.mark.parametrize("stop", [[], ["never"]])
@pytest.mark.parametrize("include", [False, True])
def test_a_stop_token_id_is_reported_but_not_written(tokenizer: Tokenizer, include: bool,
                                                     stop: list[str]) -> None:
    ids = tokenizer.encode("alpha beta\n", add_special_tokens=False).ids
    detok = Detokenizer(tokenizer)
    req = DetokRequestInfo("r", CLIENT, 3, True, 0.0, 1, stop, include)
    first = detok.feed(DetokBatch([req], [TokenDelta("r", ids[:-1])]))[CLIENT][0]
    last = detok.feed(DetokBatch([], [TokenDelta("r", ids[-1:], "stop", None, 0, None, 0,
                                                 ids[-1])]))[CLIENT][0]
    assert last.token_ids == ids[-1:] and last.stop_reason == ids[-1]
    assert last.num_output_tokens == len(ids)
    full = tokenizer.decode(ids)
    expected = full if include else tokenizer.decode(ids[:-1])
    assert first.text + last.text == expected


def test_a_stop_string_already_streamed_under_min_tokens_is_not_matched_later(
        tokenizer: Tokenizer) -> None:
    """"x" appears (and is streamed) while min_tokens still holds stops off; later tokens
    must not end the sample on that old "x"."""
    ids = tokenizer.encode("abcdefx gh ij", add_special_tokens=False).ids
    cut = len(tokenizer.encode("abcdefx", add_special_tokens=False).ids)
    outs = stream(Detokenizer(tokenizer), ids, info(["x", "zzzzzz"], min_tokens=cut))
    assert "".join(o.text for o in outs) == "abcdefx gh ij"
    assert outs[-1].finish_reason == "length"
