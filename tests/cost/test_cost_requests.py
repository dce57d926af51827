"""Cost of what a tenant sends to lora_llm: sampling_parameters (parsed on execute()'s thread), the prompt
(tokenized on an admission worker) and stop strings (matched per token on the output thread), each at n and 2n."""

import json
from pathlib import Path

import numpy as np
from cost_harness import assert_linear

ROOT = Path(__file__).resolve().parents[2]
SMOLLM2_TOKENIZER = ROOT / ".cache" / "smollm2" / "model" / "tokenizer.json"
DEMO_TOKENIZER = ROOT / ".cache" / "demo" / "model" / "tokenizer.json"


def _parse(sampling: str):
    from loraplex.triton.parsing import parse_generate_input

    inputs = {"text_input": np.array([b"hi"], dtype=object), "sampling_parameters": np.array([sampling.encode()],
                                                                                             dtype=object)}
    return lambda: parse_generate_input(inputs, {})


def deeply_nested_sampling_parameters(n: int):
    return _parse('{"stop": ' + "[" * (n * 1024) + "]" * (n * 1024) + "}")


def oversized_sampling_parameters(n: int):
    return _parse(json.dumps({"stop": ["x" * (n * 256 * 1024)]}))


def many_stop_strings(n: int):
    return _parse(json.dumps({"stop": [str(i) for i in range(n * 1024)]}))


def _tokenizer():
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(SMOLLM2_TOKENIZER if SMOLLM2_TOKENIZER.is_file() else DEMO_TOKENIZER))


def prompt_of_one_long_word(n: int):
    tokenizer, text = _tokenizer(), "a" * (n * 32 * 1024)
    return lambda: tokenizer.encode(text, add_special_tokens=False)


def prompt_of_whitespace_and_digits(n: int):
    tokenizer, text = _tokenizer(), (" 1" * 7 + "\n\t" + "é😀") * (n * 1024)
    return lambda: tokenizer.encode(text, add_special_tokens=False)


def stop_strings_matched_per_token(n: int):
    """64 stop strings of 256 characters (the bounds), none matching, over n × 256 generated tokens."""
    from transformers import PreTrainedTokenizerFast

    from loraplex.engine.detokenizer import IncrementalDetokenizer
    from loraplex.engine.request import MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS

    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(DEMO_TOKENIZER), clean_up_tokenization_spaces=False)
    stops = [("ab" * MAX_STOP_STRING_CHARS)[:MAX_STOP_STRING_CHARS - 1] + str(i % 10) + "z"
             for i in range(MAX_STOP_STRINGS)]
    stops = [s[-MAX_STOP_STRING_CHARS:] for s in stops]
    tokens = tokenizer.encode("ab" * 64, add_special_tokens=False)

    def run():
        detok = IncrementalDetokenizer(tokenizer, tokens[:4], stops)
        for i in range(n * 256):
            detok.push(tokens[i % len(tokens)])

    return run


def test_sampling_parameters_nested_deeply_cost_linear_time():
    assert_linear(deeply_nested_sampling_parameters, 64, max_seconds=0.5)


def test_sampling_parameters_over_the_bound_are_refused_at_constant_cost():
    assert_linear(oversized_sampling_parameters, 4, max_seconds=0.1)


def test_many_stop_strings_are_refused_in_linear_time():
    assert_linear(many_stop_strings, 8, max_seconds=0.5)


def test_tokenizing_a_long_word_is_linear():
    assert_linear(prompt_of_one_long_word, 4, max_seconds=1.0)


def test_tokenizing_whitespace_digits_and_emoji_is_linear():
    assert_linear(prompt_of_whitespace_and_digits, 4, max_seconds=1.0)


def test_stop_strings_at_their_bounds_cost_linear_time_in_tokens():
    assert_linear(stop_strings_matched_per_token, 4, max_seconds=2.0)
