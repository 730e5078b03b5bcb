"""Tests for stages.text_stream: ByteLevelText gives exactly tokenizers' DecodeStream pieces
(the same text at the same ids, bytes held back alike, invalid bytes, special and added tokens,
ids no token has), and the detokenizer's outputs do not depend on which stream it uses."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from tokenizers import AddedToken, Tokenizer, decoders
from tokenizers.decoders import DecodeStream

from ipc.messages import DetokBatch, DetokRequestInfo, RequestOutput, TokenDelta
from stages.detokenizer import Detokenizer
from stages.text_stream import (
    ByteLevelTable,
    ByteLevelText,
    DecodeStreamText,
    _bytes_to_chars,
    text_streams,
)


@pytest.fixture(params=["tiny", "default"])
def tokenizer(request: pytest.FixtureRequest) -> Tokenizer:
    folder: Path = request.getfixturevalue(f"{request.param}_model_dir")
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    # an added token that is not special, one whose text is not in the byte-level alphabet,
    # and a special one made of non-ASCII characters
    tok.add_tokens([AddedToken("<tool>", special=False), AddedToken("naïve ✓", special=False)])
    tok.add_special_tokens([AddedToken("<｜end▁of▁text｜>", special=True)])
    return tok


def _id_pools(tok: Tokenizer) -> dict[str, list[int]]:
    """Ids by kind, so that random streams hit the rare cases often."""
    table = ByteLevelTable(tok)
    kept = table.bytes[False]
    whole = set(table.pieces[False])
    added = list(tok.get_added_tokens_decoder())
    single = {raw[0]: i for i, raw in kept.items() if len(raw) == 1 and i not in added}
    partial = [i for i in kept if i not in whole and kept[i]]
    lead = [i for i, raw in kept.items() if raw and raw[-1] >= 0xC0 and i not in added]
    size = max(kept) + 1
    return {"any": list(kept), "added": added, "partial": partial or list(kept),
            "lead": lead or list(kept), "bytes": list(single.values()),
            "unknown": [size, size + 7, 2**32 - 1]}


def _random_ids(rng: random.Random, pools: dict[str, list[int]], n: int) -> list[int]:
    weights = {"any": 40, "added": 6, "partial": 20, "lead": 15, "bytes": 15, "unknown": 2}
    kinds = rng.choices(list(weights), list(weights.values()), k=n)
    return [rng.choice(pools[k]) for k in kinds]


def _pieces_of(stream: object, tok: Tokenizer, ids: list[int]) -> list[str]:
    if isinstance(stream, DecodeStream):
        return [stream.step(tok, t) or "" for t in ids]
    return [stream.step(t) for t in ids]  # type: ignore[attr-defined]


@pytest.mark.parametrize("skip", [True, False])
def test_byte_level_pieces_are_decode_streams(tokenizer: Tokenizer, skip: bool) -> None:
    """The same piece at every id over random id streams, and the same flush at the end."""
    table = ByteLevelTable(tokenizer)
    pools = _id_pools(tokenizer)
    rng = random.Random(7)
    for _ in range(300):
        ids = _random_ids(rng, pools, rng.randint(1, 40))
        ours = ByteLevelText(table, skip)
        theirs = DecodeStreamText(tokenizer, skip, "r")
        assert _pieces_of(ours, tokenizer, ids) == _pieces_of(theirs, tokenizer, ids), ids
        assert ours.flush() == theirs.flush(), ids
        raw = DecodeStream(skip_special_tokens=skip)
        assert _pieces_of(ByteLevelText(table, skip), tokenizer, ids) == \
            _pieces_of(raw, tokenizer, ids), ids


def test_byte_level_pieces_on_random_bytes(tokenizer: Tokenizer) -> None:
    """Byte sequences of every kind (leads, continuations, overlongs, surrogates, bytes
    never valid), one byte a token: UTF-8 decoding with replacement agrees with Rust's."""
    table = ByteLevelTable(tokenizer)
    chars = {b: c for c, b in _bytes_to_chars().items()}
    byte_ids = {b: i for b in range(256) if (i := tokenizer.token_to_id(chars[b])) is not None}
    assert len(byte_ids) > 200  # (the default's vocabulary lacks a few never seen, 0xC0 say)
    rng = random.Random(11)
    interesting = [b for b in [0x41, 0x80, 0x8F, 0x9F, 0xA0, 0xBF, 0xC0, 0xC2, 0xDF, 0xE0, 0xE1,
                               0xED, 0xEF, 0xF0, 0xF4, 0xF5, 0xFF, 0x20] if b in byte_ids]
    for _ in range(400):
        data = [rng.choice(interesting) if rng.random() < 0.8 else rng.choice(list(byte_ids))
                for _ in range(rng.randint(1, 24))]
        ids = [byte_ids[b] for b in data]
        for skip in (True, False):
            ours = ByteLevelText(table, skip)
            theirs = DecodeStreamText(tokenizer, skip, "r")
            assert _pieces_of(ours, tokenizer, ids) == _pieces_of(theirs, tokenizer, ids), data
            assert ours.flush() == theirs.flush(), data


def test_whole_stream_with_flush_adds_up_to_decode(tokenizer: Tokenizer) -> None:
    table = ByteLevelTable(tokenizer)
    pools = _id_pools(tokenizer)
    rng = random.Random(3)
    for _ in range(200):
        ids = _random_ids(rng, pools, rng.randint(1, 30))
        for skip in (True, False):
            stream = ByteLevelText(table, skip)
            text = "".join(stream.step(t) for t in ids) + (stream.flush() or "")
            assert text == tokenizer.decode(ids, skip_special_tokens=skip), ids


@pytest.mark.parametrize("bad", [-1, 2**32, 2**40])
def test_an_id_decode_cannot_take_raises_decodes_error(tiny_model_dir: Path, bad: int) -> None:
    tok = Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))
    stream = ByteLevelText(ByteLevelTable(tok), True)
    with pytest.raises(OverflowError) as ours:
        stream.step(bad)
    with pytest.raises(OverflowError) as theirs:
        tok.decode([5, bad])
    assert str(ours.value) == str(theirs.value)


def test_other_decoders_use_decode_stream(tiny_model_dir: Path) -> None:
    tok = Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))
    assert isinstance(text_streams(tok)(True, "r"), ByteLevelText)
    tok.decoder = decoders.Sequence([decoders.ByteLevel()])
    assert isinstance(text_streams(tok)(True, "r"), DecodeStreamText)
    tok.decoder = decoders.Metaspace()
    assert isinstance(text_streams(tok)(True, "r"), DecodeStreamText)


def _outputs(detok: Detokenizer, batches: list[DetokBatch]) -> list[list[RequestOutput]]:
    return [[o for outs in detok.feed(b).values() for o in outs] for b in batches]


def test_detokenizer_outputs_do_not_depend_on_the_stream(tokenizer: Tokenizer) -> None:
    """Random requests (stop strings or not, skip or not, n > 1, several ids a delta, ids
    decode cannot take) through the byte-level streams and through DecodeStream: the same
    outputs, error outputs included."""
    pools = _id_pools(tokenizer)
    pools["bad"] = [-1, 2**32]
    rng = random.Random(5)
    kinds = ["any", "added", "partial", "lead", "bytes", "unknown", "bad"]
    batches: list[DetokBatch] = []
    running: dict[str, list[int]] = {}  # request id -> its samples not finished yet
    for step in range(120):
        new = []
        if step < 100 and rng.random() < 0.4:
            info = DetokRequestInfo(f"r{step}", "ipc:///c", 3, rng.random() < 0.5, 0.0,
                                    n=rng.choice([1, 1, 2]),
                                    stop=rng.choice([[], [], ["e"], ["\ufffd", "the"],
                                                     ["ö", "a b"]]),
                                    include_stop_str_in_output=rng.random() < 0.3,
                                    min_tokens=rng.choice([0, 0, 3]))
            new.append(info)
            running[info.request_id] = list(range(info.n))
        deltas = []
        for rid, samples in running.items():
            for index in list(samples):
                ids = [rng.choice(pools[rng.choices(kinds, [40, 6, 20, 15, 15, 2, 0.3])[0]])
                       for _ in range(rng.choice([1, 1, 1, 2, 3]))]
                finish = "length" if rng.random() < 0.05 or step == 119 else None
                stop_id = ids[-1] if finish and rng.random() < 0.3 else None
                deltas.append(TokenDelta(rid, ids, finish, index=index, stop_token_id=stop_id))
                if finish:
                    samples.remove(index)
        running = {rid: samples for rid, samples in running.items() if samples}
        batches.append(DetokBatch(new, deltas))
    fast = Detokenizer(tokenizer)
    assert isinstance(fast.new_stream(True, "r"), ByteLevelText)
    slow = Detokenizer(tokenizer)
    slow.new_stream = lambda skip, request_id: DecodeStreamText(tokenizer, skip, request_id)
    assert _outputs(fast, batches) == _outputs(slow, batches)
    assert fast.stopped == slow.stopped
