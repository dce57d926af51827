"""Hypothesis strategies for hostile requests: every sampling key with wrong types and extreme values.

Shared by the parser/engine property test (tests/unit) and the server fuzz (tests/e2e).
"""

from __future__ import annotations

import math

from hypothesis import strategies as st

from loraplex.engine.request import SAMPLING_KEYS

INT_EXTREMES = [2**63 - 1, -(2**63), 2**63, 2**64, -(2**64) - 1, 10**30, 0, -1, 1, 2, 3]
FLOAT_EXTREMES = [math.nan, math.inf, -math.inf, 1e-45, 1e308, -1e308, 5e-324, 1e-5, 0.0, -0.0, 0.5]
STRING_EXTREMES = ["", " ", "nan", "NaN", "inf", "-Infinity", "1e-45", "1e308", "1e400", "18446744073709551616",
                   "-9223372036854775809", "true", "[1, 2]", "[]", "{}", "null", "\x00", "\ud800", "demo-a", "0", "1"]
MEGABYTE_PROMPT = b"a" * (1 << 20)


def _nested(depth: int):
    value: object = 1
    for _ in range(depth):
        value = [value]
    return value


HOSTILE_VALUES = st.one_of(
    st.sampled_from(INT_EXTREMES),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from(FLOAT_EXTREMES),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from(STRING_EXTREMES),
    st.text(max_size=12),
    st.booleans(),
    st.none(),
    st.lists(st.sampled_from(INT_EXTREMES), max_size=4),
    st.lists(st.sampled_from(STRING_EXTREMES), max_size=4),
    st.just(list(range(5000))),  # huge lists
    st.just(["stop"] * 5000),
    st.dictionaries(st.text(max_size=3), st.sampled_from(INT_EXTREMES), max_size=3),  # nested objects
    st.just(_nested(50)),
)

# Plausible values too, so that a good share of the requests is accepted and really runs.
PLAUSIBLE = {
    "max_tokens": st.integers(1, 12), "min_tokens": st.integers(0, 4), "temperature": st.sampled_from([0, 0.7, 1e-6]),
    "top_p": st.sampled_from([0.9, 1.0]), "top_k": st.sampled_from([-1, 0, 1, 5]), "seed": st.integers(0, 2**63 - 1),
    "n": st.integers(1, 3), "logprobs": st.integers(0, 3), "stop": st.sampled_from(["a", ["b", "c"]]),
    "ignore_eos": st.booleans(), "lora_name": st.sampled_from(["demo-a", "demo-b", "nope"]),
}

KEYS = sorted(SAMPLING_KEYS) + ["bogus", ""]


@st.composite
def sampling_parameters(draw) -> dict:
    """A dict of sampling keys, each value hostile or plausible."""
    keys = draw(st.lists(st.sampled_from(KEYS), unique=True, max_size=6))
    params = {}
    for key in keys:
        plausible = PLAUSIBLE.get(key)
        params[key] = draw(plausible if plausible is not None and draw(st.booleans()) else HOSTILE_VALUES)
    return params


PROMPTS = st.one_of(
    st.text(min_size=1, max_size=40).map(lambda s: s.encode("utf-8", "surrogatepass")),
    st.binary(max_size=40),  # mostly invalid UTF-8
    st.sampled_from([b"", b"\x00", b"a\x00b", b"\xff\xfe", b"\xc3", b"\xed\xa0\x80", "h\u00e9llo \U0001f600".encode()]),
)
