"""Incremental detokenization against the tokenizer's full decode."""

import pytest

from loraplex.engine.detokenizer import REPLACEMENT, IncrementalDetokenizer


@pytest.fixture(scope="module")
def tokenizer(demo):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(demo["model"])


@pytest.mark.parametrize("text", ["héllo wörld", "emoji 🎉🚀 and 日本語", "plain ascii"])
def test_deltas_never_split_a_character_and_concatenate_to_the_full_text(tokenizer, text):
    pieces = _deltas(tokenizer, tokenizer("x").input_ids, tokenizer(text, add_special_tokens=False).input_ids, True)
    assert "\ufffd" not in "".join(pieces)
    assert "".join(pieces) == text


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


@pytest.mark.parametrize("skip_special", [True, False])
def test_the_backend_decoder_equals_hf_decode(tokenizer, skip_special):
    import random

    from loraplex.engine.detokenizer import decoder_of

    decode = decoder_of(tokenizer, skip_special)
    assert decode.func == tokenizer._tokenizer.decode  # the fast path is the one taken here
    rng = random.Random(0)
    special = list(tokenizer.all_special_ids)
    for _ in range(200):
        ids = [rng.randrange(len(tokenizer)) for _ in range(rng.randrange(12))] + rng.sample(special, 1)
        rng.shuffle(ids)
        assert decode(ids) == tokenizer.decode(ids, skip_special_tokens=skip_special)


def test_a_tokenizer_that_cleans_up_spaces_keeps_hf_decode(tokenizer):
    from loraplex.engine.detokenizer import decoder_of

    class CleaningUp:
        _tokenizer = tokenizer._tokenizer
        clean_up_tokenization_spaces = True
        decode = tokenizer.decode

    assert decoder_of(CleaningUp(), True).func == CleaningUp().decode


def _deltas(tokenizer, prompt, out, stream: bool):
    detok = IncrementalDetokenizer(tokenizer, prompt, [])
    if not stream:
        detok._stream = None
    ids, pieces = list(prompt), []
    for t in out:
        ids.append(t)
        before = len(detok.text)
        detok.update(ids)
        pieces.append(detok.text[before:])
    before = len(detok.text)
    detok.flush(ids)
    return pieces + [detok.text[before:]]


@pytest.mark.parametrize("model", ["demo", "smollm2"])
def test_the_decode_stream_gives_the_window_paths_deltas(tokenizer, model):
    import random
    from pathlib import Path

    from loraplex.engine.detokenizer import stream_of

    if model == "smollm2":
        from transformers import AutoTokenizer

        folder = Path(__file__).resolve().parents[2] / ".cache" / "smollm2" / "model"
        if not folder.is_dir():
            pytest.skip("SmolLM2 is not converted here (make smollm2)")
        tokenizer = AutoTokenizer.from_pretrained(folder)
    assert stream_of(tokenizer, True) is not None
    rng = random.Random(1)
    texts = ["héllo wörld", "emoji 🎉🚀 and 日本語", " leading space", "The capital of France is Paris."]
    for text in texts:
        prompt = tokenizer("Say:").input_ids
        out = tokenizer(text, add_special_tokens=False).input_ids
        assert _deltas(tokenizer, prompt, out, True) == _deltas(tokenizer, prompt, out, False)
        assert "".join(_deltas(tokenizer, prompt, out, True)) == tokenizer.decode(out, skip_special_tokens=True)
    def valid(text):  # malformed bytes: how many U+FFFD they become differs between decoders (and paths)
        return text.replace(REPLACEMENT, "")

    for _ in range(100):  # random ids: byte-level decoding needs no context, so the deltas add up to the whole
        prompt = [rng.randrange(len(tokenizer)) for _ in range(rng.randrange(1, 8))]
        out = [rng.randrange(len(tokenizer)) for _ in range(rng.randrange(1, 16))]
        whole = tokenizer.decode(out, skip_special_tokens=True)
        assert valid("".join(_deltas(tokenizer, prompt, out, True))) == valid(whole)
