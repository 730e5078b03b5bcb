"""The request book alone (stages/scheduler/requests.py): n-sample siblings held until sample
0's prompt is planned, finals and their outputs, what is remembered for a lost detokenizer
and a reconciling client (recent finals, forgotten clients, early aborts), re-validation."""

from __future__ import annotations

from ipc.config import EngineLimits
from ipc.messages import (
    ErrorKind,
    FinishReason,
    SamplingParams,
    StructuredOutputs,
    TokenColumns,
    TokenDelta,
    TokenizedRequest,
    TokenLogprob,
)
from stages.scheduler.requests import (
    MAX_FORGOTTEN_CLIENTS,
    RequestBook,
    invalid_reason,
)
from stages.scheduler.sequence import SeqStatus, Sequence

LIMITS = EngineLimits(max_num_seqs=4, max_num_batched_tokens=16, block_size=4,
                      max_model_len=64, vocab_size=1000)


def add(book: RequestBook, rid: str, n: int = 1, reply_to: str = "client",
        prompt: int = 6, params: SamplingParams | None = None) -> list[Sequence]:
    p = SamplingParams(n=n) if params is None else params
    req = TokenizedRequest(rid, reply_to, list(range(10, 10 + prompt)), p, 0.0)
    seqs = [Sequence(rid, list(req.prompt_token_ids), p, 0.0, index=i, reply_to=reply_to,
                     status=SeqStatus.HELD if i else SeqStatus.WAITING) for i in range(n)]
    book.add(req, seqs)
    return seqs


def test_siblings_wait_until_sample_zeros_prompt_is_planned() -> None:
    book = RequestBook()
    first, *siblings = add(book, "r", n=3)
    assert book.held == {"r": siblings} and book.prompt_tokens == 6
    assert [i.request_id for i in book.new_infos] == ["r"] and book.new_infos[0].n == 3
    first.move_to(SeqStatus.RUNNING)
    first.num_computed = 5
    assert book.siblings_ready() == [] and book.held == {"r": siblings}
    first.num_computed = 6  # its whole prompt is planned: its full blocks are cached
    assert book.siblings_ready() == siblings
    assert all(s.status is SeqStatus.WAITING for s in siblings) and not book.held


def test_siblings_go_when_sample_zero_ends_first() -> None:
    book = RequestBook()
    first, second = add(book, "r", n=2)
    book.finish(first, FinishReason.ABORT)
    assert book.siblings_ready() == [second]


def test_a_held_sample_that_ends_leaves_the_hold() -> None:
    book = RequestBook()
    _, second, third = add(book, "r", n=3)
    book.finish(second, FinishReason.ABORT)
    assert book.held == {"r": [third]} and second.status is SeqStatus.FINISHED
    assert book.finished == {"abort": 1} and second in book.touched


def test_a_request_is_gone_with_its_last_sample() -> None:
    book = RequestBook()
    first, second = add(book, "r", n=2)
    for seq in (first, second):
        book.finish(seq, FinishReason.STOP)
    book.remove(first)
    assert book.is_live(second) and not book.is_live(first)
    book.remove(second)
    assert "r" not in book.requests and not book.held


def test_outputs_carry_new_tokens_once_and_the_final() -> None:
    book = RequestBook()
    seq = add(book, "r")[0]
    seq.output_ids += [5, 6]
    book.touched[seq] = None
    infos, deltas, rejected, _ = book.take_outputs()
    assert [i.request_id for i in infos] == ["r"] and not rejected
    assert [(d.token_ids, d.finish_reason) for d in deltas] == [([5, 6], None)]
    assert book.take_outputs() == ([], [], [], TokenColumns())
    seq.move_to(SeqStatus.RUNNING)
    book.finish(seq, FinishReason.LENGTH)
    (delta,) = book.take_outputs().deltas
    assert delta.token_ids == [] and delta.finish_reason is FinishReason.LENGTH


def test_steady_deltas_come_as_columns_and_the_rest_as_deltas() -> None:
    """take_outputs(columns=True): a sample's one new token, unfinished, without logprobs,
    goes in the columns (its index and cached prompt tokens with it); two tokens, a finish,
    logprobs or prompt logprobs make a TokenDelta; together the same deltas as without."""
    book = RequestBook()
    plain = add(book, "plain", n=2)
    two = add(book, "two")[0]
    ends = add(book, "ends")[0]
    lps = add(book, "lps", params=SamplingParams(max_tokens=8, logprobs=0))[0]
    plps = add(book, "plps", params=SamplingParams(max_tokens=8, prompt_logprobs=0))[0]
    book.take_outputs()  # (the request infos)
    for seq in [*plain, two, ends, lps, plps]:
        if seq.status is SeqStatus.HELD:  # (sample 1 of "plain")
            seq.move_to(SeqStatus.WAITING)
        seq.move_to(SeqStatus.RUNNING)
        seq.output_ids.append(7)
        seq.output_logprobs.append(TokenLogprob(7, -0.5))
        book.touched[seq] = None
    two.output_ids.append(8)
    plain[1].num_cached_tokens = 16
    book.finish(ends, FinishReason.STOP)
    touched = dict(book.touched)
    out = book.take_outputs(columns=True)
    assert out.plain == TokenColumns(["plain", "plain"], [7, 7], [0, 1], [0, 16])
    assert sorted(d.request_id for d in out.deltas) == ["ends", "lps", "plps", "two"]
    for seq in touched:
        seq.num_sent = 0
    book.touched = touched
    whole = book.take_outputs().deltas
    assert sorted(out.deltas + out.plain.deltas(), key=key) == sorted(whole, key=key)


def key(delta: TokenDelta) -> tuple[str, int]:
    return delta.request_id, delta.index


def test_a_lost_detokenizers_recent_finals_end_again_with_an_error() -> None:
    book = RequestBook()
    for rid in ("mine", "theirs", "failed"):
        seq = add(book, rid)[0]
        book.finish(seq, FinishReason.STOP)
        book.remove(seq)
    book.take_outputs()
    assert book.known(["mine", "theirs", "never"]) == ["mine", "theirs"]  # ended lately
    book.prune_finals()  # (nothing is 10 s old yet)
    failed = {"failed"}
    book.fail_recent(lambda rid: rid != "theirs", failed, "detokenizer:0 stopped")
    rejected = book.take_outputs().rejected
    assert [(r.request_id, r.error_kind) for r in rejected] == [("mine", ErrorKind.UNAVAILABLE)]
    assert failed == {"failed", "mine"}


def test_a_forgotten_client_and_early_aborts() -> None:
    book = RequestBook()
    add(book, "a", reply_to="dead")
    add(book, "b", reply_to="alive")
    assert book.forget_client("dead") == ["a"] and "dead" in book.forgotten
    for i in range(MAX_FORGOTTEN_CLIENTS):
        book.forget_client(f"c{i}")
    assert "dead" not in book.forgotten and len(book.forgotten) == MAX_FORGOTTEN_CLIENTS
    book.note_early_abort("soon")
    assert book.was_aborted("soon") and not book.was_aborted("soon")  # asked once


def test_requests_are_validated_again() -> None:
    def request(ids: list[int], **params: object) -> TokenizedRequest:
        return TokenizedRequest("r", "c", ids, SamplingParams(**params), 0.0)  # type: ignore

    assert invalid_reason(request([1, 2]), LIMITS) is None
    assert invalid_reason(request([]), LIMITS) == "the prompt is empty"
    assert "outside the vocabulary" in (invalid_reason(request([1000]), LIMITS) or "")
    assert "must leave room" in (invalid_reason(request([1] * 64), LIMITS) or "")
    bare = request([1], structured_outputs=StructuredOutputs(regex="a"))  # no grammar text
    assert "grammar" in (invalid_reason(bare, LIMITS) or "")
