"""frequency_penalty: each token's logit lowered by F times how often it occurs in the output so far (OpenAI's
formula; vLLM's `frequency_penalty`; negative values favour repeats)."""

from dgemma.knobs.base import LOGITS, Knob, knob_option, number_in


def _apply(logits, f, history):
    return logits.sub_(f * history.counts(logits.shape[-1], logits.device))


KNOB = Knob(knob_option("frequency_penalty", float, "F", "lower each token's logit by F x its count in the output so "
                        "far (in [-2, 2]; 0: off)", number_in("frequency_penalty", -2.0, 2.0)),
            LOGITS, _apply, off=(0, 0.0))
