"""logit_bias: a bias in [-100, 100] added to chosen tokens' logits before everything else (OpenAI's `logit_bias`:
-100 bans a token, 100 all but forces it). Given as {token id: bias}; the request field's keys are the ids as
strings, as OpenAI's are; on the command line ID=BIAS, repeatable."""

import math

from dgemma.errors import SamplingParamsError
from dgemma.knobs.base import LOGITS, Knob, knob_option

MAX_ENTRIES = 1024


def _normalize(value):
    """{id: bias} (ids as ints or digit strings) or (id, bias) pairs -> sorted (id, bias) pairs: hashable."""
    pairs = value.items() if isinstance(value, dict) else value
    try:
        pairs = [(k, v) for k, v in pairs]
    except (TypeError, ValueError):
        raise SamplingParamsError("logit_bias must map token ids to numbers", "logit_bias") from None
    return tuple(sorted({_id(k): v for k, v in pairs}.items()))  # a repeated id: its last bias


def _id(key) -> int:
    if isinstance(key, bool) or not isinstance(key, (int, str)) or (isinstance(key, str) and not key.isdigit()):
        raise SamplingParamsError(f"logit_bias: {key!r} is not a token id", "logit_bias")
    return int(key)


def _check(value, vocab_size=None) -> None:
    if len(value) > MAX_ENTRIES:
        raise SamplingParamsError(f"logit_bias has {len(value)} entries; at most {MAX_ENTRIES}", "logit_bias")
    for token, bias in value:
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not math.isfinite(bias) \
                or not -100 <= bias <= 100:
            raise SamplingParamsError(f"logit_bias[{token}]={bias!r} must be a number in [-100, 100]", "logit_bias")
        if vocab_size is not None and not 0 <= token < vocab_size:
            raise SamplingParamsError(f"logit_bias: token id {token} is outside the vocabulary (0..{vocab_size - 1})",
                                      "logit_bias")


def id_bias(word: str):
    token, sep, bias = word.partition("=")
    try:
        return int(token), float(bias)
    except ValueError:
        raise SamplingParamsError(f"--logit-bias {word!r} must be ID=BIAS", "logit_bias") from None


def _apply(logits, pairs, history):
    ids = [t for t, _ in pairs]
    logits[:, ids] += logits.new_tensor([b for _, b in pairs])
    return logits


KNOB = Knob(knob_option("logit_bias", dict, "ID=BIAS", "add BIAS (in [-100, 100]; -100 bans) to token ID's logit "
                        "(repeatable)", _check, normalize=_normalize, parse=id_bias,
                        wire_type=dict[str, float]),
            LOGITS, _apply, off=((),))
