"""The scheduler's proposers for speculative decoding (in the scheduler process, which holds
every sequence's tokens; docs/ARCHITECTURE.md, "Speculative decoding").

n-gram prompt lookup: a decoding sequence's last N tokens (down to M) are looked up among its
earlier tokens, prompt and output, and the tokens that followed their latest occurrence are
proposed. Proposals cost no model: what the executor verifies is what was proposed; the
sampler decides what stands.

A draft model: the executor runs it, so the scheduler plans only how many positions a row
drafts, each a DRAFT_TOKEN placeholder that the device fills before the forward.

Each sequence keeps an index of its n-grams (n = M..N -> where the latest one ends), extended
as its tokens become known, so a proposal is a few dictionary lookups whatever the length.
A sequence whose drafts keep missing backs off: after each further all-rejected row it skips
twice as many steps before proposing again (at most MAX_SKIP), so free-form text costs little.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ipc.speculative import SpeculativeConfig
from ipc.step import DRAFT_TOKEN

MAX_SKIP = 64


@dataclass
class ProposalState:
    """One sequence's back-off (either proposer) and n-gram index (n-gram proposals)."""

    tokens: list[int] = field(default_factory=list)  # its known tokens, as indexed
    ends: dict[tuple[int, ...], int] = field(default_factory=dict)  # n-gram -> latest end
    num_indexed: int = 0  # n-grams ending before this position are in `ends`
    misses: int = 0  # drafted rows in a row with nothing accepted
    skip: int = 0  # planned steps left without proposing


class Proposer:
    """What the scheduler asks of a proposer: `propose` drafts for a sequence, `record` a
    drafted row's result (a sequence whose drafts keep missing backs off: both proposers
    share it; each says what it proposes in `_drafts`)."""

    def __init__(self, cfg: SpeculativeConfig) -> None:
        self.cfg = cfg

    def propose(self, state: ProposalState, prompt: list[int], outputs: list[int],
                num_pending: int, max_drafts: int) -> list[int]:
        """Up to max_drafts tokens to follow a sequence whose known tokens are its prompt
        and the outputs seen so far, with num_pending tokens still being sampled; none
        while it backs off."""
        if max_drafts <= 0:
            return []
        if state.skip:
            state.skip -= 1
            return []
        return self._drafts(state, prompt, outputs, num_pending, max_drafts)

    def _drafts(self, state: ProposalState, prompt: list[int], outputs: list[int],
                num_pending: int, max_drafts: int) -> list[int]:
        raise NotImplementedError

    @staticmethod
    def record(state: ProposalState, num_accepted: int) -> None:
        """A drafted row's result: back off after misses, start over after a hit."""
        if num_accepted:
            state.misses = 0
            return
        state.misses += 1
        state.skip = min(MAX_SKIP, (1 << (state.misses - 1)) - 1)


def make_proposer(cfg: SpeculativeConfig) -> Proposer:
    return DraftModelProposer(cfg) if cfg.is_draft_model else NgramProposer(cfg)


class DraftModelProposer(Proposer):
    """max_drafts placeholders, which the executor's draft model fills."""

    def _drafts(self, state: ProposalState, prompt: list[int], outputs: list[int],
                num_pending: int, max_drafts: int) -> list[int]:
        return [DRAFT_TOKEN] * max_drafts


class NgramProposer(Proposer):
    def _drafts(self, state: ProposalState, prompt: list[int], outputs: list[int],
                num_pending: int, max_drafts: int) -> list[int]:
        """The outputs seen so far (new ones since the last call join the index) and the
        continuation of the longest matching n-gram, past the pending tokens it presumably
        predicts. A continuation that runs out (its occurrence was near the end) is
        continued by looking up again, as if what it predicted were known: a repeating
        pattern is followed past its last repetition."""
        self._extend(state, prompt, outputs)
        want = num_pending + max_drafts
        ahead: list[int] = []  # predicted past the known tokens: the pending, then drafts
        while len(ahead) < want:
            more = self._continuation(state, ahead, want - len(ahead))
            if not more:
                break
            ahead += more
        return ahead[num_pending:]

    def _continuation(self, state: ProposalState, ahead: list[int], most: int) -> list[int]:
        """What followed the latest earlier occurrence of the longest suffix (N down to M
        tokens) of the known tokens followed by `ahead`; at most `most` tokens."""
        tokens, cfg = state.tokens, self.cfg
        for n in range(min(cfg.ngram_max, len(tokens) + len(ahead) - 1), cfg.ngram_min - 1, -1):
            suffix = (ahead[-n:] if len(ahead) >= n
                      else tokens[len(tokens) - (n - len(ahead)):] + ahead)
            end = state.ends.get(tuple(suffix))
            if end is not None:
                more = tokens[end + 1:end + 1 + most]
                if more:
                    return more
        return []

    def _extend(self, state: ProposalState, prompt: list[int], outputs: list[int]) -> None:
        """Index the n-grams ending before the last known token (the last one is what a
        lookup matches; its own occurrence must not answer it)."""
        tokens = state.tokens
        if len(tokens) < len(prompt):
            tokens += prompt[len(tokens):]
        tokens += outputs[len(tokens) - len(prompt):]
        lo, hi = self.cfg.ngram_min, self.cfg.ngram_max
        ends = state.ends
        for i in range(state.num_indexed, len(tokens) - 1):
            for n in range(lo, min(hi, i + 1) + 1):
                ends[tuple(tokens[i + 1 - n:i + 1])] = i
        state.num_indexed = max(state.num_indexed, len(tokens) - 1)
