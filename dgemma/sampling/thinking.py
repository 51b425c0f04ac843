"""The thinking budget (`max_thinking_tokens`): a reply that opens a thought channel (its first id is the channel's
open id) closes it after at most `tokens` thought ids. Diffusion pins the close id into the canvas at the position the
budget reaches, as a layout's fixed token, so the answer is denoised after it in the same canvas; the token-by-token
engines make the close the next token once the thought holds `tokens` ids. A thought the model closes earlier is its
own."""

from __future__ import annotations

from dataclasses import dataclass

from dgemma.errors import SamplingParamsError

MAX_THINKING_TOKENS = 1_000_000


@dataclass(frozen=True)
class ThoughtBudget:
    open: int
    close: int
    tokens: int

    def check(self) -> None:
        t = self.tokens
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t <= MAX_THINKING_TOKENS:
            raise SamplingParamsError(f"max_thinking_tokens={t!r} must be an integer in [0, {MAX_THINKING_TOKENS}]",
                                      "max_thinking_tokens")

    def position(self, output: list[int], first: int | None) -> int | None:
        """Where, counted from the end of the committed `output`, the close must go; None: nowhere (no thought, or
        it closed). `first`: the id the next canvas settled at its first position (None: not settled), which opens
        the thought when nothing is committed yet."""
        if not output:
            return 1 + self.tokens if first == self.open else None
        n = len(output) - 1  # thought ids committed
        if output[0] != self.open or n > self.tokens or self.close in output[1:]:
            return None
        return self.tokens - n

    def forced(self, output: list[int], pending: list[int] = ()) -> int | None:
        """The next id token by token after `output` and the `pending` ids chosen before it: the close once the
        thought holds `tokens` ids, else None (free). Reads at most `tokens` + 1 ids."""
        ids = list(output[:1] or pending[:1])
        if ids != [self.open] or len(output) + len(pending) != self.tokens + 1:
            return None
        return None if self.close in output[1:] or self.close in pending else self.close
