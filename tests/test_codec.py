"""Wire codec: round trips of every message type, the `[TAG, *fields]` layout, and the
`ProtocolError` raised for every kind of malformed or misdirected input."""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass
from typing import Any, ClassVar

import msgpack
import pytest

from ipc.codec import Codec, ProtocolError, encode
from ipc.messages import (
    ALL_MESSAGES,
    AbortRequest,
    AddRequest,
    ChatMessage,
    DetokBatch,
    DetokRequestInfo,
    EngineDown,
    EngineReconcile,
    ErrorKind,
    FinishReason,
    ForgetClient,
    JoinedRankDied,
    LastStep,
    Members,
    Message,
    OutputColumns,
    PipelineStatus,
    Reconcile,
    ReconcileAnswer,
    RemoteSampled,
    RemoteStep,
    RequestOutput,
    RequestOutputs,
    SampledTokens,
    SamplingParams,
    SchedulerStats,
    StageAlive,
    StageFailed,
    StageLeaving,
    StageReady,
    StageRestarted,
    StepPlan,
    StopSample,
    TokenColumns,
    TokenDelta,
    TokenizedRequest,
    TokenLogprob,
)

PARAMS = SamplingParams(max_tokens=64, temperature=0.7, stop_token_ids=[2, 32000],
                        ignore_eos=True, skip_special_tokens=False)

SAMPLES: list[Message] = [
    AddRequest("req-1", "ipc:///tmp/client.sock", "Bonjour, ça va? 你好 🙂", None, None,
               PARAMS, 1712.25),
    AddRequest("req-2", "tcp://10.0.0.1:5555", None, [1, 15043, 29892], None,
               SamplingParams(), 0.0),
    AddRequest("req-3", "reply", None, None,
               [ChatMessage("system", "Sei breve."), ChatMessage("user", "Ωμέγα ≠ omega")],
               SamplingParams(max_tokens=None, temperature=0.0), 3.5),
    AbortRequest("req-1"),
    TokenizedRequest("req-2", "tcp://10.0.0.1:5555", [1, 15043, 29892, 0], PARAMS, 99.0),
    DetokBatch(
        [DetokRequestInfo("a", "r", 12, True, 1.0), DetokRequestInfo("b", "r", 3, False, 2.0)],
        [TokenDelta("a", [5, 6, 7]), TokenDelta("b", [], "stop"),
         TokenDelta("c", [], "error", "duplicate request id")],
    ),
    DetokBatch([], []),
    RequestOutputs([
        RequestOutput("a", "héllo wörld", [5, 6], False, None, None, 12, 2),
        RequestOutput("b", "", [], True, "length", None, 3, 16),
        RequestOutput("c", "", [], True, "error", "prompt too long ✗", 0, 0),
    ]),
    StepPlan(17, 1, 3, 130, 9, 2, 5),
    StepPlan(0, 0, 1, 1, 0, 0, 0),
    StopSample("req-1", 2),
    SampledTokens(17, 1, 2, 10.5, 10.75),
    LastStep(17),
    LastStep(-1),
    RemoteStep(StepPlan(17, 1, 3, 130, 9, 2, 5), {"stamp": b"\x11" * 16, "input_ids": b""}),
    RemoteSampled(SampledTokens(17, 1, 2, 10.5, 10.75, 5, 0, [b"\x00\x01"]),
                  {"token_ids": bytes(16)}),
    JoinedRankDied(0, 1, "10.0.0.1:29500", "executor:1 died"),
    StageReady("executor", 0, 4242, {"num_kv_blocks": 1024, "max_num_seqs": 8}),
    StageReady("tokenizer", 3, 17, {}),
    StageFailed("detokenizer", 1, 99, "Traceback: ☠ out of memory"),
    SchedulerStats(100, 97, 8, 7, 3, 2, 1, 0, 1, 1, 0, 42),
    PipelineStatus(1.5, {"executor:0": True, "scheduler:0": False}, "scheduler:0 died",
                   SchedulerStats(100, 97, 8, 7, 3, 2, 1, 0, 1, 1, 0, 42, 10, 4, 2,
                                  {"stop": 3, "abort": 1}, 50, 60, [1, 2], 0.5, [3], 7, 0.01,
                                  12.0)),
    PipelineStatus(2.0, {}, None, None),
    PipelineStatus(2.5, {"tokenizer:0": True}, None, None, {"tokenizer:0": 2}),
    Reconcile("ipc:///tmp/r/client-1.sock", 1, ["req-1", "req-2"]),
    ForgetClient("ipc:///tmp/r/client-1.sock"),
    StageRestarted("detokenizer", 1),
    EngineReconcile(7, 1, ["req-1", "req-2"]),
    ReconcileAnswer(7, 1, ["req-2"]),
    EngineDown(1, "scheduler:1 died"),
    EngineDown(0, "executor:0 died", 3),
    DetokBatch([], [], [], 1),
    RequestOutputs([RequestOutput("c", "", [], True, "error", "prompt too long ✗", 0, 0)],
                   OutputColumns(["a", "b"], [" wörld", ""], [5, 9], [0, 1], [12, 3], [2, 7],
                                 [0, 16])),
    DetokBatch([], [TokenDelta("a", [5, 6])], [], 0, 2,
               TokenColumns(["b", "c", "c"], [7, 8, 9], [0, 0, 1], [0, 16, 16])),
    PipelineStatus(3.0, {}, None, None, {}, [10, 0], [True, False]),
    Members(3, ["ipc:///tmp/r/scheduler.sock", "", "tcp://10.0.0.2:7001"], [], [""], [False]),
    Members(4, ["", "ipc:///s"], [], [], [], {"0": "executor:0 died, exit code -9: x"}),
    StageAlive("scheduler", 2),
    StageLeaving("detokenizer", 1, "interrupted"),
    PipelineStatus(4.0, {"scheduler:2": True}, None, None, {}, [0, 0, 5], [True, False, True],
                   {"scheduler:2": "tcp://10.0.0.2:7002"}, True),
]

ALL = Codec(ALL_MESSAGES)


def unpack(data: bytes) -> Any:
    return msgpack.unpackb(data, raw=False)


def pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def assert_decode_error(codec: Codec, obj: Any) -> ProtocolError:
    with pytest.raises(ProtocolError) as info:
        codec.decode(pack(obj))
    return info.value


# ---------------------------------------------------------------- round trips


def test_samples_cover_every_message_type() -> None:
    assert {type(m) for m in SAMPLES} == set(ALL_MESSAGES)


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda m: type(m).__name__)
def test_round_trip(msg: Message) -> None:
    data = encode(msg)
    decoded = ALL.decode(data)
    assert decoded == msg
    assert type(decoded) is type(msg)


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda m: type(m).__name__)
def test_round_trip_on_a_channel_of_its_own_type(msg: Message) -> None:
    assert Codec([type(msg)]).decode(Codec.encode(msg)) == msg


def test_nested_structs_decode_to_their_types() -> None:
    batch = ALL.decode(encode(SAMPLES[5]))
    assert isinstance(batch, DetokBatch)
    assert all(type(i) is DetokRequestInfo for i in batch.new_requests)
    assert all(type(d) is TokenDelta for d in batch.deltas)
    chat = ALL.decode(encode(SAMPLES[2]))
    assert isinstance(chat, AddRequest) and chat.messages is not None
    assert all(type(m) is ChatMessage for m in chat.messages)
    assert type(chat.params) is SamplingParams


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda m: type(m).__name__)
def test_encoding_is_an_array_with_the_tag_first(msg: Message) -> None:
    raw = unpack(encode(msg))
    assert isinstance(raw, list)
    assert raw[0] == msg.TAG
    names = [f.name for f in dataclasses.fields(msg)]  # type: ignore[arg-type]
    assert len(raw) == 1 + len(names)


def test_nested_struct_travels_as_a_plain_array() -> None:
    raw = unpack(encode(SAMPLES[0]))
    assert raw[6][:5] == [64, 0.7, [2, 32000], True, False]
    assert len(raw[6]) == len(dataclasses.fields(SamplingParams))


def test_tags_are_unique() -> None:
    tags = [m.TAG for m in ALL_MESSAGES]
    assert len(tags) == len(set(tags))


# ---------------------------------------------------------------- malformed bytes


@pytest.mark.parametrize("data", [
    b"", b"\xc1", b"\x92\x01", b"\xdc\xff\xff", b"\x93\x07\x01",
    pack([7, 1, 2]) + b"\x00",  # trailing bytes
], ids=["empty", "reserved", "truncated-array", "truncated-header", "truncated", "trailing"])
def test_malformed_msgpack_raises(data: bytes) -> None:
    with pytest.raises(ProtocolError):
        ALL.decode(data)


@pytest.mark.parametrize("obj", [
    7, "hello", None, {"tag": 7}, [], ["7", 1, 2, 3], [7.0, 1, 2, 3], [True, 1, 2, 3], [None],
], ids=["int", "str", "nil", "map", "empty-array", "str-tag", "float-tag", "bool-tag", "nil-tag"])
def test_not_a_tagged_array_raises(obj: Any) -> None:
    err = assert_decode_error(ALL, obj)
    assert err.raw == obj


def test_truncated_encodings_of_every_sample_raise() -> None:
    for msg in SAMPLES:
        data = encode(msg)
        for end in range(len(data)):
            with pytest.raises(ProtocolError):
                ALL.decode(data[:end])


def test_unknown_tag_raises() -> None:
    err = assert_decode_error(ALL, [999, "x"])
    assert err.raw == [999, "x"]
    assert "999" in str(err)


def test_known_tag_on_the_wrong_channel_raises() -> None:
    scheduler_inbox = Codec([TokenizedRequest, AbortRequest])
    with pytest.raises(ProtocolError) as info:
        scheduler_inbox.decode(encode(SampledTokens(1, 0, 1)))
    assert info.value.raw == [SampledTokens.TAG, 1, 0, 1, 0.0, 0.0, -1, 0, []]
    assert scheduler_inbox.decode(encode(AbortRequest("x"))) == AbortRequest("x")


def test_empty_codec_accepts_nothing() -> None:
    with pytest.raises(ProtocolError):
        Codec([]).decode(encode(AbortRequest("x")))


# ---------------------------------------------------------------- wrong field types


def _with(msg: Message, index: int, value: Any) -> list[Any]:
    raw = unpack(encode(msg))
    raw[1 + index] = value
    return raw


def _with_output_field(index: int, value: Any) -> list[Any]:
    """A RequestOutputs whose one output has every field (decoded inline, in one call) and
    field `index` set to value."""
    raw = unpack(encode(RequestOutputs([RequestOutput("r", "x", [5], False, None, None, 3, 1)])))
    raw[1][0][index] = value
    return raw


BAD_FIELDS: list[tuple[str, list[Any]]] = [
    ("bool-for-one-id", _with_output_field(2, [True])),
    ("float-for-one-id", _with_output_field(2, [5.0])),
    ("str-for-one-id", _with_output_field(2, ["5"])),
    ("bool-among-ids", _with_output_field(2, [5, False])),
    ("bad-enum-in-full-struct", _with_output_field(4, "exploded")),
    ("float-for-optional-str-or-int", _with_output_field(9, 1.5)),
    ("int-for-optional-list", _with_output_field(10, 5)),
    ("bad-optional-error-kind", _with_output_field(12, "nobody's")),
    ("str-for-int", _with(SampledTokens(1, 0, 1), 0, "1")),
    ("bool-for-int", _with(SampledTokens(1, 0, 1), 2, True)),
    ("float-for-int", _with(SampledTokens(1, 0, 1), 1, 1.0)),
    ("nil-for-int", _with(SampledTokens(1, 0, 1), 0, None)),
    ("int-for-str", _with(AbortRequest("x"), 0, 5)),
    ("bytes-for-str", _with(AbortRequest("x"), 0, b"x")),
    ("str-for-float", _with(SampledTokens(1, 0, 1), 3, "1.5")),
    ("bool-for-float", _with(SampledTokens(1, 0, 1), 3, False)),
    ("float-list-for-int-list", _with(SAMPLES[4], 2, [1.0, 2.0])),
    ("bool-in-int-list", _with(SAMPLES[4], 2, [1, True])),
    ("str-for-int-list", _with(SAMPLES[4], 2, "1 2 3")),
    ("nil-for-required-list", _with(SAMPLES[4], 2, None)),
    ("int-for-struct", _with(SAMPLES[4], 3, 5)),
    ("map-for-struct", _with(SAMPLES[4], 3, {"max_tokens": 5})),
    ("bad-nested-field", _with(SAMPLES[4], 3, [5, 1.0, [2], "yes", True])),
    ("bad-list-item-struct", _with(DetokBatch([], []), 1, [["a", [1], 7]])),
    ("int-for-output-text", _with(RequestOutputs([]), 1, [["a"], [5], [5], [0], [1], [1], [0]])),
    ("int-for-column-str", _with(DetokBatch([], []), 5, [[1], [7], [0], [0]])),
    ("str-for-column-int", _with(DetokBatch([], []), 5, [["a"], ["7"], [0], [0]])),
    ("short-column", _with(DetokBatch([], []), 5, [["a", "b"], [7, 8], [0, 0], [0]])),
    ("short-output-column", _with(RequestOutputs([]), 1,
                                  [["a"], ["x"], [5], [0], [1], [1], []])),
    ("short-nested-struct", _with(DetokBatch([], []), 0, [["a", "r", 1]])),
    ("str-for-optional-list", _with(SAMPLES[1], 3, "1 2")),
    ("int-for-bool", _with(SAMPLES[4], 3, [5, 1.0, [2], 1, True])),
    ("int-for-nested-bool", [DetokBatch.TAG, [["a", "r", 1, 1, 0.0]], []]),
    ("dict-int-value-str", _with(SAMPLES[11], 3, {"num_kv_blocks": "1024"})),
    ("list-for-dict", _with(SAMPLES[11], 3, [["num_kv_blocks", 1]])),
    ("missing-required", unpack(encode(SampledTokens(1, 0, 1)))[:3]),
    ("missing-all", [AbortRequest.TAG]),
    ("too-many", [*unpack(encode(SampledTokens(1, 0, 1))), 0.0]),
    ("too-many-nested", _with(SAMPLES[4], 3, unpack(encode(AddRequest(
        "r", "a", "p", None, None, SamplingParams(), 0.0)))[6] + [0])),
]


@pytest.mark.parametrize("raw", [r for _, r in BAD_FIELDS], ids=[n for n, _ in BAD_FIELDS])
def test_wrong_field_raises_with_raw_attached(raw: list[Any]) -> None:
    err = assert_decode_error(ALL, raw)
    assert err.raw == raw


def test_error_message_names_the_field() -> None:
    err = assert_decode_error(ALL, _with(SampledTokens(1, 0, 1), 0, "1"))
    assert "SampledTokens.step_id" in str(err)


def test_int_is_accepted_for_float_fields() -> None:
    msg = ALL.decode(pack([SampledTokens.TAG, 3, 0, 1, 10, 11]))
    assert msg == SampledTokens(3, 0, 1, 10.0, 11.0)
    assert isinstance(msg, SampledTokens) and type(msg.device_start) is float
    nested = ALL.decode(pack([RequestOutputs.TAG,
                              [["r", "", [5], True, None, None, 0, 1, 0, None, [[5, -1]]]]]))
    assert isinstance(nested, RequestOutputs)
    logprobs = nested.outputs[0].logprobs
    assert logprobs is not None and type(logprobs[0].logprob) is float


def test_finish_reasons_and_error_kinds_decode_as_their_enums() -> None:
    out = RequestOutput.refusal("r", ErrorKind.INVALID_REQUEST, "bad", "top_p", 3)
    back = ALL.decode(encode(RequestOutputs([out])))
    assert isinstance(back, RequestOutputs) and back.outputs == [out]
    assert back.outputs[0].finish_reason is FinishReason.ERROR
    assert back.outputs[0].error_kind is ErrorKind.INVALID_REQUEST
    raw = [RequestOutputs.TAG, [["r", "", [], True, "exploded", None, 0, 0]]]
    with pytest.raises(ProtocolError, match="'exploded' is not a FinishReason"):
        ALL.decode(pack(raw))


def test_defaulted_trailing_fields_may_be_omitted() -> None:
    assert ALL.decode(pack([SampledTokens.TAG, 4, 1, 2])) == SampledTokens(4, 1, 2, 0.0, 0.0)
    assert ALL.decode(pack([SampledTokens.TAG, 4, 1, 2, 5.0])) == SampledTokens(4, 1, 2, 5.0)
    delta = ALL.decode(pack([DetokBatch.TAG, [], [["a", [1, 2]]]]))
    assert delta == DetokBatch([], [TokenDelta("a", [1, 2], None, None)])
    info = ALL.decode(pack([DetokBatch.TAG, [], [["a", [], "stop"]]]))
    assert info == DetokBatch([], [TokenDelta("a", [], "stop", None)])


def test_sampling_params_fields_all_default() -> None:
    raw = unpack(encode(SAMPLES[4]))
    raw[4] = []
    msg = ALL.decode(pack(raw))
    assert isinstance(msg, TokenizedRequest)
    assert msg.params == SamplingParams()


def test_optional_fields_accept_none() -> None:
    raw = [TokenizedRequest.TAG, "r", "to", [1], [None, 1.0, [], False, True], 0.0]
    msg = ALL.decode(pack(raw))
    assert isinstance(msg, TokenizedRequest) and msg.params.max_tokens is None


# ---------------------------------------------------------------- fuzz


def _mutations(rng: random.Random, data: bytes) -> bytes:
    buf = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        if not buf:
            break
        buf[rng.randrange(len(buf))] = rng.randrange(256)
    return bytes(buf)


def _decode_or_protocol_error(codec: Codec, data: bytes) -> None:
    try:
        msg = codec.decode(data)
    except ProtocolError:
        return
    assert isinstance(msg, Message)


def test_fuzz_random_bytes_only_raise_protocol_error() -> None:
    rng = random.Random(1234)
    for _ in range(3000):
        data = rng.randbytes(rng.randint(0, 64))
        _decode_or_protocol_error(ALL, data)


def test_fuzz_random_bytes_behind_a_valid_tag_only_raise_protocol_error() -> None:
    rng = random.Random(99)
    for _ in range(3000):
        tag = rng.choice(ALL_MESSAGES).TAG
        header = bytes([0x90 | rng.randint(1, 9), tag])
        _decode_or_protocol_error(ALL, header + rng.randbytes(rng.randint(0, 48)))


def test_fuzz_mutated_valid_messages_only_raise_protocol_error() -> None:
    rng = random.Random(7)
    encoded = [encode(m) for m in SAMPLES]
    for _ in range(5000):
        _decode_or_protocol_error(ALL, _mutations(rng, rng.choice(encoded)))


def test_enums_print_as_their_values() -> None:
    # The CLI and the HTTP errors write them into text: "(length)", not "(FinishReason.LENGTH)".
    assert (str(FinishReason.LENGTH), f"{FinishReason.ABORT}", f"{ErrorKind.INTERNAL}") == (
        "length", "abort", "internal")


def test_a_message_without_fields_round_trips() -> None:
    @dataclass(frozen=True, slots=True)
    class Ping(Message):
        TAG: ClassVar[int] = 99

    assert Codec([Ping]).decode(encode(Ping())) == Ping()


def test_lists_of_structs_pack_as_each_item_would_alone() -> None:
    """encode maps a list of one struct type to tuples in one pass: the bytes are those of
    msgpack's default called on each item, and a list that mixes types is left to it."""
    from ipc.codec import _to_wire  # (the per-item path)
    delta = TokenDelta("a", [1, 2], FinishReason.STOP, None, 1,
                       [TokenLogprob(1, -0.5, [1], [-0.5])], 3, 2, None)
    info = DetokRequestInfo("b", "client", 2, True, 1.5, 2, ["x"])
    for msg in (DetokBatch([info], [delta, delta], [], 2, 1),
                DetokBatch([], [delta, info], [], 0, 0)):  # (mixed: not one struct type)
        fields = [getattr(msg, f.name) for f in dataclasses.fields(msg)]
        want = msgpack.packb((msg.TAG, *fields), default=_to_wire, use_bin_type=True)
        assert encode(msg) == want
