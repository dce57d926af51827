"""The gateway's tools: checking, the forced-call schema, the fallback prompt, and parsing calls (whole and
streamed) out of Hermes/Qwen ``<tool_call>`` blocks and bare JSON."""

from __future__ import annotations

import json

import jsonschema
import pytest
from pydantic import ValidationError

from loraplex.openai.errors import OpenAIError
from loraplex.openai.protocol import ChatCompletionRequest, CompletionRequest
from loraplex.openai.tool_output import ToolOutput
from loraplex.openai.tools import (MAX_TOOLS, Holding, ToolError, call_schema, check_tools, chosen, held_back,
                                   hermes_blocks,
                                   parse_tool_calls, template_messages)

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}
NAMES = {"get_weather", "add"}
MESSAGES = [{"role": "user", "content": "Hi"}]


def calls(text):
    content, found = parse_tool_calls(text, NAMES)
    return content, [(c.name, json.loads(c.arguments)) for c in found]


@pytest.mark.parametrize("text, want", [
    ('<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>', ("", [("add", {"a": 1, "b": 2})])),
    ('Let me check.\n<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>\n'
     '<tool_call>{"name": "add", "arguments": "{\\"a\\": 1, \\"b\\": 2}"}</tool_call>',
     ("Let me check.", [("get_weather", {"city": "Oslo"}), ("add", {"a": 1, "b": 2})])),
    ('<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}', ("", [("add", {"a": 1, "b": 2})])),  # unclosed
    ('{"name": "add", "arguments": {"a": 1, "b": 2}}', ("", [("add", {"a": 1, "b": 2})])),  # the fallback's format
    (' [{"name": "add", "parameters": {"a": 3, "b": 4}}]', ("", [("add", {"a": 3, "b": 4})])),
    ('{"name": "launch", "arguments": {}}', ('{"name": "launch", "arguments": {}}', [])),  # no such tool
    ('<tool_call>not json</tool_call>', ('<tool_call>not json</tool_call>', [])),
    ('{"name": "add", "arguments": [1]}', ('{"name": "add", "arguments": [1]}', [])),  # arguments not an object
    ("Just text {with braces}", ("Just text {with braces}", [])),
])
def test_tool_calls_are_parsed_and_text_that_is_no_call_stays_content(text, want):
    assert calls(text) == want


def test_calls_get_openai_ids_and_shape():
    _, found = parse_tool_calls('{"name": "add", "arguments": {"a": 1, "b": 2}}', NAMES)
    call = found[0].as_openai()
    assert call["id"].startswith("call_") and len(call["id"]) > 10 and call["type"] == "function"
    assert call["function"] == {"name": "add", "arguments": '{"a": 1, "b": 2}'}


def test_streamed_auto_sends_content_and_holds_a_possible_call():
    out = ToolOutput("auto", NAMES)
    pieces = ["Hi ", "there <tool", '_call>{"name": "add", ', '"arguments": {"a": 1, "b": 2}}</tool_call>']
    deltas = [d for p in pieces for d in out.stream(0, p, None)] + out.stream(0, "", "stop")
    assert [d for d, _ in deltas[:-1]] == [{"content": "Hi "}, {"content": "there "}]
    last, finish = deltas[-1]
    assert finish == "tool_calls" and last["tool_calls"][0]["index"] == 0
    assert last["tool_calls"][0]["function"] == {"name": "add", "arguments": '{"a": 1, "b": 2}'}
    plain = ToolOutput("auto", NAMES)
    assert plain.stream(1, "Hello <to", None) == [({"content": "Hello "}, None)]
    assert plain.stream(1, "x", None) == [({"content": "<tox"}, None)]  # no longer a prefix of the tag
    assert plain.stream(1, "", "length") == [({}, "length")]
    bare = ToolOutput("auto", NAMES)
    assert bare.stream(0, '{"name": "ad', None) == []  # may be a bare JSON call: held
    assert bare.stream(0, 'd", "arguments": {"a": 1, "b": 2}}', "stop")[0][1] == "tool_calls"
    json_text = ToolOutput("auto", NAMES)
    json_text.stream(0, '{"x": 1}', None)
    assert json_text.stream(0, "", "stop") == [({"content": '{"x": 1}'}, "stop")]  # held, then content


def test_forced_output_is_one_call_or_the_cut_text():
    named = ToolOutput("add", NAMES)
    assert named.message('{"name": "add", "arguments": {"a": 1, "b": 2}}', "stop")[1] == "tool_calls"
    message, finish = named.message('{"name": "add", "argu', "length")
    assert message == {"role": "assistant", "content": '{"name": "add", "argu'} and finish == "length"
    assert named.stream(0, '{"name": "add", ', None) == []


def test_held_back():
    assert held_back("plain text") == 0 and held_back("text <tool_c") == len("<tool_c")
    assert held_back("a <tool_call>{") == len("<tool_call>{") and held_back("  {") == 3 and held_back("") == 0


def test_forced_schemas_accept_only_the_chosen_tools_arguments():
    tools = check_tools([WEATHER, ADD])
    named = call_schema(tools, "add")
    jsonschema.validate({"name": "add", "arguments": {"a": 1, "b": 2}}, named)
    for bad in ({"name": "get_weather", "arguments": {"city": "x"}}, {"name": "add", "arguments": {"a": 1}}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, named)
    required = call_schema(tools, "required")
    jsonschema.validate({"name": "get_weather", "arguments": {"city": "x"}}, required)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"name": "nope", "arguments": {}}, required)


@pytest.mark.parametrize("tools, choice, message", [
    ([{"type": "function"}], None, "tools[0]"), ([{"type": "function", "function": {"name": "bad name"}}], None, "name"),
    ([ADD, ADD], None, "twice"), ([ADD], {"type": "function", "function": {"name": "sub"}}, "not among"),
    ([ADD], "sometimes", "tool_choice must be"),
])
def test_bad_tools_and_choices_are_refused(tools, choice, message):
    with pytest.raises(ToolError) as e:
        chosen(choice, check_tools(tools))
    assert message in str(e.value)


def test_tools_are_bounded_before_they_are_read():
    with pytest.raises(ValidationError, match="129 tools; at most"):
        ChatCompletionRequest(messages=MESSAGES, tools=[ADD] * (MAX_TOOLS + 1))
    with pytest.raises(ToolError, match="bytes"):
        check_tools([{"type": "function", "function": {"name": f"f{i}", "description": "x" * 2000}}
                     for i in range(40)])


def test_tool_choice_sets_the_grammar_and_response_format_maps_to_structured_outputs():
    req = ChatCompletionRequest(messages=MESSAGES, tools=[WEATHER, ADD], tool_choice="required")
    assert req.sampling_parameters(8)["structured_outputs"] == {
        "json": call_schema(check_tools([WEATHER, ADD]), "required"), "disable_any_whitespace": True}
    assert "structured_outputs" not in ChatCompletionRequest(messages=MESSAGES, tools=[ADD]).sampling_parameters(8)
    schema = {"type": "object", "properties": {"x": {"type": "integer"}}}
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}}
    assert ChatCompletionRequest(messages=MESSAGES, response_format=fmt).sampling_parameters(8)[
        "structured_outputs"] == {"json": schema}
    assert CompletionRequest(prompt="a", response_format={"type": "json_object"}).sampling_parameters()[
        "structured_outputs"] == {"json_object": True}
    assert CompletionRequest(prompt="a", guided_choice=["x", "y"]).sampling_parameters()["guided_choice"] == ["x", "y"]
    for fields, param in (({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
                          ({"response_format": {"type": "yaml"}}, "response_format"),
                          ({"response_format": {"type": "json_object"}, "guided_regex": "a+"}, "response_format"),
                          ({"tools": [ADD], "tool_choice": "required", "guided_regex": "a+"}, "tool_choice"),
                          ({"functions": [{"name": "f"}]}, "functions")):
        with pytest.raises(OpenAIError) as e:
            ChatCompletionRequest(messages=MESSAGES, **fields).sampling_parameters(8)
        assert (e.value.status, e.value.param) == (400, param)


def test_fallback_prompt_and_history_for_a_template_without_tools():
    history = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Add 1 and 2"},
               {"role": "assistant", "content": "", "tool_calls": [
                   {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "3"}]
    tools = check_tools([ADD])
    out = template_messages(history, tools, template_reads_tools=False)
    assert out[0]["role"] == "system" and '"name": "add"' in out[0]["content"] and out[0]["content"].endswith("Be brief.")
    assert json.loads(out[2]["content"]) == {"name": "add", "arguments": {"a": 1, "b": 2}} and "tool_calls" not in out[2]
    assert out[3] == {"role": "user", "content": "Result of call_1: 3"}
    native = template_messages(history, tools, template_reads_tools=True)
    assert native[2]["tool_calls"][0]["function"]["arguments"] == {"a": 1, "b": 2} and native[3]["role"] == "tool"
    assert native[0] == history[0]


def test_holding_piece_by_piece_equals_held_back_of_the_whole():
    for text in ("plain text <tool_c", "a <tool_call>{", "  {", "", "   ", "x <tool_call>1</tool_call> y", "no tag here"):
        for step in (1, 2, 5):
            holding = Holding()
            held = [holding.add(text[i:i + step]) for i in range(0, len(text), step)] or [holding.add("")]
            assert held[-1] == held_back(text), (text, step)


def test_hermes_blocks_are_found_by_one_pass():
    text = "a <tool_call> {1} </tool_call> b <tool_call>\n{2}  "
    assert hermes_blocks(text) == [(2, 30, "{1}"), (33, len(text), "{2}")]
    assert hermes_blocks("<tool_call>x" + " " * 10 + "y") == [(0, 23, "x" + " " * 10 + "y")]
