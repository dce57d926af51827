"""Incremental detokenization against the tokenizer's full decode."""

import pytest

from loraplex.detokenizer import IncrementalDetokenizer


@pytest.fixture(scope="module")
def tokenizer(demo):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(demo["model"])


@pytest.mark.parametrize("text", ["héllo wörld", "emoji 🎉🚀 and 日本語", "plain ascii"])
def test_deltas_never_split_a_character_and_concatenate_to_the_full_text(tokenizer, text):
    prompt = tokenizer("x").input_ids
    out = tokenizer(text, add_special_tokens=False).input_ids
    detok = IncrementalDetokenizer(tokenizer, prompt, [])
    ids, pieces = list(prompt), []
    for t in out:
        ids.append(t)
        before = len(detok.text)
        detok.update(ids)
        pieces.append(detok.text[before:])
    detok.flush(ids)
    assert "\ufffd" not in "".join(pieces)
    assert detok.text == text


def test_stop_string_truncates_and_is_held_back(tokenizer):
    prompt = tokenizer("x").input_ids
    detok = IncrementalDetokenizer(tokenizer, prompt, ["STOP"])
    ids = list(prompt)
    matched = None
    for t in tokenizer("abcSTOPdef", add_special_tokens=False).input_ids:
        ids.append(t)
        matched = detok.update(ids) or matched
        if matched:
            break
        assert detok.stable_length(False) <= max(len(detok.text) - 3, 0)
    assert matched == "STOP" and detok.text == "abc"
