"""Sampling-parameter parsing and the vllm_backend input rules (no server)."""

import json

import numpy as np
import pytest

from loraplex.engine.request import SamplingParams
from loraplex.exceptions import InvalidRequest
from loraplex.triton.parsing import parse_generate_input


def text(s):
    return np.array([s.encode()], dtype=np.object_)


def test_defaults_match_vllm():
    p = SamplingParams.from_dict({})
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.n) == (16, 1.0, 1.0, -1, 1)


def test_string_values_parse_as_their_type():
    p = SamplingParams.from_dict(
        {"temperature": "0", "top_p": "0.95", "max_tokens": "7", "ignore_eos": "true", "seed": "3", "stop": "END"}
    )
    assert (p.temperature, p.top_p, p.max_tokens, p.ignore_eos, p.seed, p.stop) == (0.0, 0.95, 7, True, 3, ["END"])
    assert SamplingParams.from_dict({"stop": '["a", "b"]'}).stop == ["a", "b"]


@pytest.mark.parametrize(
    "values, message",
    [
        ({"bogus": 1}, "unknown sampling parameter 'bogus'"),
        ({"max_tokens": "many"}, "'max_tokens' has value 'many'"),
        ({"max_tokens": 1.5}, "'max_tokens'"),
        ({"max_tokens": 0}, "max_tokens must be >= 1, got 0"),
        ({"temperature": -0.5}, "temperature must be >= 0, got -0.5"),
        ({"top_p": 0}, "top_p must be in (0, 1], got 0.0"),
        ({"top_p": 1.5}, "top_p must be in (0, 1], got 1.5"),
        ({"ignore_eos": "maybe"}, "'ignore_eos'"),
        ({"presence_penalty": 0.5}, "'presence_penalty' is not supported"),
    ],
)
def test_bad_values_are_rejected_with_the_key(values, message):
    with pytest.raises(InvalidRequest) as err:
        SamplingParams.from_dict(values)
    assert message in str(err.value)


def test_neutral_penalties_are_accepted():
    SamplingParams.from_dict({"presence_penalty": 0, "frequency_penalty": "0", "repetition_penalty": 1.0})


def test_missing_and_empty_text_input():
    with pytest.raises(InvalidRequest, match="missing required input 'text_input'"):
        parse_generate_input({}, {})
    with pytest.raises(InvalidRequest, match="text_input is empty"):
        parse_generate_input({"text_input": text("")}, {})


def test_echo_rules_follow_vllm_backend():
    plain = parse_generate_input({"text_input": text("hi")}, {})
    assert (plain.stream, plain.exclude_input) == (False, False)
    streamed = parse_generate_input({"text_input": text("hi"), "stream": np.array([True])}, {})
    assert streamed.exclude_input
    with pytest.raises(InvalidRequest) as err:
        parse_generate_input(
            {"text_input": text("hi"), "stream": np.array([True]), "exclude_input_in_output": np.array([False])}, {}
        )
    # vllm_backend's clients compare this text word for word
    assert str(err.value) == (
        "Error generating stream: When streaming, `exclude_input_in_output` = False is not allowed."
    )


def test_sampling_json_and_request_parameters_and_tenant():
    inputs = {"text_input": text("hi"), "sampling_parameters": text(json.dumps({"max_tokens": 3}))}
    parsed = parse_generate_input(inputs, {"temperature": 0, "tenant": "acme", "unrelated": 1}, "acme")
    assert (parsed.params.max_tokens, parsed.params.temperature, parsed.tenant) == (3, 0.0, "acme")
    assert parse_generate_input(inputs, {"x-api-key": "k", "api_key": "k"}).params.max_tokens == 3  # not sampling keys
    with pytest.raises(InvalidRequest, match="not valid JSON"):
        parse_generate_input({"text_input": text("hi"), "sampling_parameters": text("{nope")}, {})


def test_sampling_parameters_over_the_byte_bound_are_refused_before_they_are_parsed(monkeypatch):
    from loraplex.triton import parsing

    def never(*_):
        raise AssertionError("parsed")

    monkeypatch.setattr(parsing.json, "loads", never)
    body = '{"stop": ["' + "x" * parsing.MAX_SAMPLING_PARAMETERS_BYTES + '"]}'
    with pytest.raises(InvalidRequest, match=f"at most {parsing.MAX_SAMPLING_PARAMETERS_BYTES} are accepted"):
        parse_generate_input({"text_input": text("hi"), "sampling_parameters": text(body)}, {})


def test_request_parameters_over_their_bound_are_refused_unparsed(monkeypatch):
    from loraplex.triton import parsing

    assert parsing.request_parameters('{"x-api-key": "k"}') == {"x-api-key": "k"}
    assert parsing.request_parameters(None) == {} == parsing.request_parameters("")
    monkeypatch.setattr(parsing.json, "loads", lambda *_: pytest.fail("parsed"))
    with pytest.raises(InvalidRequest, match=f"over {parsing.MAX_REQUEST_PARAMETERS_CHARS} characters"):
        parsing.request_parameters('{"junk": "' + "x" * parsing.MAX_REQUEST_PARAMETERS_CHARS + '"}')


def test_a_client_request_id_never_writes_a_log_line_of_its_own():
    from loraplex.triton.parsing import MAX_LOGGED_ID_CHARS, loggable_id

    assert loggable_id("abc-123 é") == "abc-123 é"
    forged = loggable_id("x\nSignal (6) received.\r\n")
    assert "\n" not in forged and "\r" not in forged and forged.startswith("x\\nSignal")
    assert len(loggable_id("a" * 10_000)) == MAX_LOGGED_ID_CHARS
