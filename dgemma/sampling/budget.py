"""The token budget of a constrained answer: a short valid completion from a grammar state, found by a search
over the grammar's token masks, so that a row can reserve the tokens it needs to end validly (the rule:
`RowGrammar` in constraints.py).

The search (`Completions.shortest`) walks from the matcher's state until the grammar is complete: forced tokens
(llguidance's fast-forward) are taken as they are; otherwise the few allowed tokens that rank first among short
candidates (closing characters `"}])` first, special tokens, then single characters) are scored one token
ahead: completes the grammar, else a value may end after it (a closing or separating token is allowed), else
the fewest tokens allowed after it (a closed string or number allows few; string content allows almost any).
At a structural choice (few tokens allowed: which key, which kind of value, whether an object goes on) each
candidate is instead judged by the length of its greedy completion (a rollout). The result is a valid
completion, so its length is an upper bound on the shortest one; None when none is found within the limit.
"""

from __future__ import annotations

import llguidance
import numpy as np

CLOSERS = b'}])"'
ENDERS = {bytes([c]) for c in b'}])",'}  # first bytes of tokens that end a value
CANDIDATES = 8  # allowed candidates looked at one token ahead per search step
STRUCTURAL = 64  # a state allowing at most this many tokens is a structural choice (not free content)
MAX_SEARCH = 512  # completions longer than this are not searched for (the budget then reserves nothing)


class Completions:
    """Per vocabulary: the ranked short candidates; `shortest` per grammar state."""

    def __init__(self, tokenizer: llguidance.LLTokenizer, vocab_size: int, excluded: set[int]):
        self.vocab_size = vocab_size
        self.excluded = np.array(sorted(excluded), dtype=np.int64)
        self.ranked, self.enders = _ranked(tokenizer, vocab_size, excluded)

    def shortest(self, matcher: llguidance.LLMatcher, limit: int, plan: bool = True,
                 exit: int | None = None) -> list[int] | None:
        """A valid completion (token ids, the EOS not included) from `matcher`'s state, at most `limit` tokens;
        None when none is found. `matcher` is not changed. `plan`: structural choices are made by rollouts.
        `exit`: a token taken whenever allowed (a thought channel's close: the way out of free text)."""
        m, path = matcher.deep_copy(), []
        limit = min(limit, MAX_SEARCH)
        while not m.is_accepting():
            forced = m.compute_ff_tokens()
            step = forced if forced else [self._best(m, plan, exit)]
            if step[0] is None or len(path) + len(step) > limit:
                return None
            if m.try_consume_tokens(step) != len(step):
                return None
            path += step
        return path

    def still_completes(self, matcher: llguidance.LLMatcher, tokens: list[int]) -> bool:
        """Whether `tokens` is a valid completion from `matcher`'s state (which is not changed)."""
        m = matcher.deep_copy()
        return m.try_consume_tokens(tokens) == len(tokens) and m.is_accepting()

    def _best(self, m: llguidance.LLMatcher, plan: bool, exit: int | None = None) -> int | None:
        """The next token: `exit` when allowed, else the best-scored candidate; at a structural choice (few tokens
        allowed: a key, the kind of a value, whether an object goes on) with `plan`, the one whose greedy completion
        is shortest."""
        words = _words(m)
        if exit is not None and _bits(words, np.array([exit]))[0]:
            return exit
        picks = self.ranked[_bits(words, self.ranked)][:CANDIDATES].tolist()
        if not picks:
            return self._first_allowed(words)
        scores = [self._score(m, t) for t in picks]
        if plan and len(picks) > 1 and _count(words) <= STRUCTURAL:
            scores = [(self._rollout(m, t), score) for t, score in zip(picks, scores)]
        return picks[min(range(len(picks)), key=scores.__getitem__)]

    def _rollout(self, m: llguidance.LLMatcher, token: int) -> int:
        """The length of the greedy completion after `token` (not bounded by the caller's limit, so that a
        search finds the same completion whatever its limit)."""
        ahead = m.deep_copy()
        ahead.consume_token(token)
        rest = self.shortest(ahead, MAX_SEARCH, plan=False)
        return MAX_SEARCH + 1 if rest is None else len(rest)

    def _score(self, m: llguidance.LLMatcher, token: int) -> tuple[int, ...]:
        """How close `token` leaves the grammar to its end (smaller is closer): complete; else whether a closing
        or separating token may follow (the value can end), then the fewest tokens allowed."""
        ahead = m.deep_copy()
        ahead.consume_token(token)
        if ahead.is_accepting():
            return (0,)
        words = _words(ahead)
        return (1, not _bits(words, self.enders).any(), _count(words))

    def _first_allowed(self, words: np.ndarray) -> int | None:
        """The lowest allowed id that is not excluded (the fallback when no short candidate is allowed)."""
        allowed = np.unpackbits(words.view(np.uint8), bitorder="little")[:self.vocab_size].astype(bool)
        allowed[self.excluded] = False
        rest = np.flatnonzero(allowed)
        return int(rest[0]) if len(rest) else None


def _words(m: llguidance.LLMatcher) -> np.ndarray:
    """The matcher's token mask as 32-bit words (bit t % 32 of word t // 32: token t allowed)."""
    return np.frombuffer(m.compute_bitmask(), dtype=np.uint32)


def _bits(words: np.ndarray, ids: np.ndarray) -> np.ndarray:
    return ((words[ids >> 5] >> (ids & 31).astype(np.uint32)) & 1).astype(bool)


_POPCOUNT = np.array([bin(i).count("1") for i in range(256)], dtype=np.int32)  # numpy < 2 has no bitwise_count


def _count(words: np.ndarray) -> int:
    return int(_POPCOUNT[words.view(np.uint8)].sum())


def _ranked(tokenizer: llguidance.LLTokenizer, vocab_size: int, excluded: set[int]) -> tuple[np.ndarray, np.ndarray]:
    """Short candidate ids, best first: closing characters only (shorter first), special tokens, `0`, other
    single ASCII punctuation and digits, single letters; and the ids of tokens that end a value."""
    keyed, enders = [], []
    for t in range(vocab_size):
        if t in excluded:
            continue
        raw = tokenizer.decode_bytes([t])
        if raw[:1] in ENDERS:
            enders.append(t)
        if tokenizer.is_special_token(t):
            keyed.append(((1, 0), t))
        elif raw and all(b in CLOSERS for b in raw) and len(raw) <= 4:
            keyed.append(((0, len(raw), CLOSERS.index(raw[-1])), t))
        elif len(raw) == 1 and 33 <= raw[0] < 127:
            c = chr(raw[0])
            keyed.append(((2 if not c.isalpha() else 3, c != "0", c), t))
    keyed.sort()
    return np.array([t for _, t in keyed], dtype=np.int64), np.array(enders, dtype=np.int64)
