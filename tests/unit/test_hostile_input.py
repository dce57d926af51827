"""Property: hostile input is refused with InvalidRequest or runs to exactly one final output.

Hypothesis draws every sampling key with wrong types and extreme values, as the JSON
input and as request parameters, and text_input bytes (invalid UTF-8, NUL, 1 MB). The
parser may only raise InvalidRequest; the engine may only refuse with InvalidRequest or
AdapterNotFound; whatever it accepts runs to one final output and leaves it idle.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from hostile import MEGABYTE_PROMPT, PROMPTS, sampling_parameters
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from loraplex.config import EngineConfig
from loraplex.engine.llm_engine import LLMEngine
from loraplex.exceptions import AdapterNotFound, InvalidRequest
from loraplex.triton.parsing import parse_generate_input
from loraplex.triton.errors import error_message


def inputs_of(prompt: bytes, sampling: dict | None, stream: bool | None) -> dict:
    inputs = {"text_input": np.array([prompt], dtype=np.object_)}
    if sampling is not None:
        inputs["sampling_parameters"] = np.array([json.dumps(sampling).encode()], dtype=np.object_)
    if stream is not None:
        inputs["stream"] = np.array([stream])
    return inputs


def parse(prompt: bytes, sampling, parameters: dict, stream):
    """The parsed request, or None when it is refused (only ever with InvalidRequest)."""
    try:
        return parse_generate_input(inputs_of(prompt, sampling, stream), parameters)
    except InvalidRequest as exc:
        message = error_message(exc)
        assert message and len(message) < 2100
        message.encode("utf-8")  # always sendable
        return None


@pytest.fixture(scope="module")
def engine(demo):
    adapters = {name: str(demo[name]) for name in ("demo-a", "demo-b")}
    return LLMEngine(EngineConfig(model_dir=str(demo["model"]), multi_lora=adapters, max_model_len=48,
                                  max_num_seqs=16))


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(prompt=PROMPTS, sampling=st.none() | sampling_parameters(), parameters=sampling_parameters(),
       stream=st.none() | st.booleans())
def test_the_parser_refuses_only_with_invalid_request(prompt, sampling, parameters, stream):
    parse(prompt, sampling, parameters, stream)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(batch=st.lists(st.tuples(PROMPTS, sampling_parameters()), min_size=1, max_size=6))
def test_accepted_requests_end_once_and_the_engine_returns_to_idle(engine, batch):
    accepted = []
    for i, (prompt, sampling) in enumerate(batch):
        parsed = parse(prompt, sampling, {}, None)
        if parsed is None:
            continue
        try:
            request = engine.make_request(f"r{i}", parsed.prompt, parsed.params)
        except (InvalidRequest, AdapterNotFound):
            continue
        engine.add_request(request)
        accepted.append(request)
    outputs: dict[str, list] = {}
    for _ in range(2000):
        if not engine.has_work():
            break
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
    assert not engine.has_work()
    event(f"accepted {min(len(accepted), 3)}+" if len(accepted) >= 3 else f"accepted {len(accepted)}")
    for request in accepted:  # one error output last, or every sample finished exactly once
        outs = outputs[request.request_id]
        errors = [o for o in outs if o.error is not None]
        if errors:
            assert len(errors) == 1 and outs[-1] is errors[0], outs
        else:
            assert sorted(o.index for o in outs if o.finished) == list(range(request.params.n)), outs
    kv = engine.kv_manager
    kv.check_invariants()
    assert kv.num_free_blocks == kv.num_blocks and engine.adapters.total_pins() == 0
    assert engine.num_waiting_requests() == 0 and engine._requests == {}


def test_a_megabyte_prompt_is_refused_by_its_bytes_before_tokenizing(engine):
    parsed = parse(MEGABYTE_PROMPT, None, {}, None)
    size = len(parsed.prompt.encode("utf-8"))
    assert engine.max_prompt_bytes == 48 * 5  # max_model_len x the byte tokenizer's longest token ("<pad>")
    with pytest.raises(InvalidRequest) as err:
        engine.make_request("big", parsed.prompt, parsed.params)
    assert str(err.value) == f"text_input is {size} bytes; at most 240 are accepted (max_prompt_bytes)"


@pytest.mark.parametrize("prompt, message", [
    (b"\xff\xfe", "text_input is not valid UTF-8 (byte 0: invalid start byte)"),
    (b"ok \xc3", "text_input is not valid UTF-8 (byte 3: unexpected end of data)"),
])
def test_invalid_utf8_prompts_are_refused_with_the_byte(prompt, message):
    with pytest.raises(InvalidRequest) as err:
        parse_generate_input(inputs_of(prompt, None, None), {})
    assert str(err.value).startswith(message)


def test_nul_bytes_are_text(engine):
    parsed = parse_generate_input(inputs_of(b"a\x00b", None, None), {})
    assert engine.make_request("nul", parsed.prompt, parsed.params).prompt == "a\x00b"
