"""Cost of what a caller sends the OpenAI gateway (and what the gateway parses out of a model's output), each
at n and 2n: the multipart upload (long part headers, Content-Type parameters, many tiny parts, many header
lines), JSON bodies (nested arrays, deep nesting, long stop / stop_token_ids / logit_bias lists, wide tool
schemas), rendered chat messages, tool-call text (whitespace runs, streamed one character at a time), streamed
choice text, and the redaction of error texts. Every one runs on the event loop (or a render thread), so
each must stay linear and well under a second at the gateway's bounds."""


from cost_harness import assert_linear

BOUNDARY = "XyZ"
CONTENT_TYPE = f"multipart/form-data; boundary={BOUNDARY}"
KIB = 1024


def _multipart(content_type: str, body: bytes):
    from loraplex.openai.lora_api import multipart_fields

    return lambda: multipart_fields(content_type, body)


def _closed(parts: bytes) -> bytes:
    return parts + f"--{BOUNDARY}--\r\n".encode()


# ---- multipart (POST /v1/lora_adapters) -------------------------------------------------------------------
def long_part_header(n: int):
    """One part whose Content-Disposition is ``form-data; aaaa…`` (n KiB of 'a', no '=')."""
    head = b"Content-Disposition: form-data; " + b"a" * (n * KIB)
    return _multipart(CONTENT_TYPE, _closed(b"--XyZ\r\n" + head + b"\r\n\r\nvalue\r\n"))


def long_boundary(n: int):
    """A Content-Type boundary of n KiB: ``x``, a space, then 'b's (unquoted: no '=' ends the run of 'b's)."""
    boundary = "x " + "b" * (n * KIB)
    body = f'--{boundary}\r\nContent-Disposition: form-data; name="name"\r\n\r\nx\r\n--{boundary}--\r\n'.encode()
    return _multipart(f"multipart/form-data; boundary={boundary}", body)


def many_tiny_parts(n: int):
    """Eight named parts, then n MiB of the tiniest parts there are (no header, no content)."""
    named = b"".join(b"--XyZ\r\nContent-Disposition: form-data; name=f%d\r\n\r\n\r\n" % i for i in range(8))
    tiny = b"--XyZ\r\n\r\n\r\n"
    return _multipart(CONTENT_TYPE, _closed(named + tiny * (n * KIB * KIB // len(tiny))))


def many_header_lines(n: int):
    """One part with n × 16 Ki header lines."""
    head = b"X: y\r\n" * (n * 16 * KIB) + b'Content-Disposition: form-data; name="name"'
    return _multipart(CONTENT_TYPE, _closed(b"--XyZ\r\n" + head + b"\r\n\r\nx\r\n"))


def test_a_long_part_header_is_refused_at_its_bound():
    assert_linear(long_part_header, 8, max_seconds=0.05, repeats=1)


def test_a_long_boundary_is_refused_at_constant_cost():
    assert_linear(long_boundary, 8, max_seconds=0.05, repeats=1)


def test_many_tiny_parts_stop_at_the_part_bound():
    assert_linear(many_tiny_parts, 16, max_seconds=0.05, repeats=1)


def test_many_header_lines_are_refused_at_the_header_bound():
    assert_linear(many_header_lines, 32, max_seconds=0.05, repeats=1)


# ---- JSON bodies (every JSON route, parsed on the event loop) ----------------------------------------------
def _json_body(model_name: str, body: str):
    from loraplex.openai import protocol, tokens
    from loraplex.openai.bodies import parse_json
    from loraplex.openai.limits import Limits

    model = getattr(protocol, model_name, None) or getattr(tokens, model_name)
    raw = body.encode()
    return lambda: parse_json(raw, model, Limits())


def _filled(template: str, item: str, n: int) -> str:
    """``template`` with each ``@`` replaced by ``item``s, to n × 512 KiB in all."""
    count = (n * 512 * KIB - len(template)) // (len(item) + 1) // template.count("@")
    return template.replace("@", ",".join([item] * count))


CHAT = '{"messages": [{"role": "user", "content": "x"}], '


def schema_of_nested_arrays(n: int):
    """response_format.json_schema of n × 512 KiB of empty arrays (the costliest JSON per byte)."""
    return _json_body("ChatCompletionRequest", _filled(
        CHAT + '"response_format": {"type": "json_schema", "json_schema": {"schema": {"enum": [@]}}}}', "[]", n))


def deeply_nested_body(n: int):
    """n × 512 Ki opening brackets in a constraint."""
    return _json_body("CompletionRequest", '{"prompt": "x", "guided_json": ' + "[" * (n * 512 * KIB) + "}")


def long_counted_lists(n: int):
    """stop, stop_token_ids and logit_bias, each n × 512 KiB: refused by their counts before validation."""
    bodies = [_json_body("CompletionRequest", _filled('{"prompt": "x", "stop": [@]}', '"s"', n)),
              _json_body("CompletionRequest", _filled('{"prompt": "x", "stop_token_ids": [@]}', "1", n)),
              _json_body("CompletionRequest", '{"prompt": "x", "logit_bias": {' + ",".join(
                  f'"{i:07d}": 0' for i in range(n * 512 * KIB // 13)) + "}}")]
    return lambda: [call_refused(b) for b in bodies]


def call_refused(call):
    try:
        call()
    except Exception:  # noqa: BLE001 (the refusal is the outcome measured)
        return
    raise AssertionError("a list over its count was accepted")


def content_parts_and_extras(n: int):
    """One message of n × 512 KiB of text parts and extra fields (passed to the template as they are)."""
    return _json_body("ChatCompletionRequest", _filled(
        '{"messages": [{"role": "user", "content": [@], "x": [@]}]}', '{"type": "text", "text": ""}', n))


def lists_of_invalid_items(n: int):
    """Token ids, prompt token ids and content parts, each n × 512 KiB of items of the wrong type: a refusal names
    the first one (pydantic would otherwise build one error per item)."""
    bodies = [_json_body("DetokenizeRequest", _filled('{"tokens": [@]}', '"x"', n)),
              _json_body("CompletionRequest", _filled('{"prompt": [[@]]}', '"x"', n)),
              _json_body("ChatCompletionRequest", _filled('{"messages": [{"role": "user", "content": [@]}]}', "1", n))]
    return lambda: [call_refused(b) for b in bodies]


def detokenize_ids(n: int):
    """/detokenize's token list, n × 512 KiB of ids."""
    return _json_body("DetokenizeRequest", _filled('{"tokens": [@]}', "1", n))


def test_a_schema_of_nested_arrays_parses_in_linear_time_within_the_body_bound():
    assert_linear(schema_of_nested_arrays, 2, max_seconds=1.0, repeats=1)


def test_a_deeply_nested_body_is_refused_at_the_recursion_bound():
    assert_linear(deeply_nested_body, 2, max_seconds=0.1, repeats=1)


def test_long_stop_and_logit_bias_lists_are_refused_by_their_counts():
    assert_linear(long_counted_lists, 2, max_seconds=1.0)


def test_content_parts_and_message_extras_parse_in_linear_time():
    assert_linear(content_parts_and_extras, 2, max_seconds=1.0, repeats=1)


def test_lists_of_invalid_items_are_refused_at_their_first_item():
    assert_linear(lists_of_invalid_items, 1, max_seconds=0.2, repeats=1)


def test_detokenize_ids_parse_in_linear_time():
    assert_linear(detokenize_ids, 2, max_seconds=1.0, repeats=1)


# ---- tools and tool_choice ---------------------------------------------------------------------------------
def wide_tool_schemas(n: int):
    """128 tools whose parameters fill n × 8 KiB (the tools' bound is 64 KiB), forced by tool_choice "required"
    (one anyOf schema of all of them)."""
    from loraplex.openai.protocol import ChatCompletionRequest

    each = n * 8 * KIB // 128 // 5
    tools = [{"type": "function", "function": {"name": f"f{i}", "parameters": {
        "type": "object", "properties": {"a": {"enum": ["x"] * each}}}}} for i in range(128)]
    body = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], tools=tools, tool_choice="required")
    return lambda: body.sampling_parameters(None)


def test_wide_tool_schemas_and_a_forced_choice_cost_linear_time():
    assert_linear(wide_tool_schemas, 2, max_seconds=0.5, repeats=1)


# ---- what the gateway parses out of a model's output -------------------------------------------------------
NAMES = {"add"}


def tool_call_with_a_whitespace_run(n: int):
    """A non-streamed ``auto`` choice: ``<tool_call>x``, n × 8 Ki spaces, ``y`` (the output a grammar can force)."""
    from loraplex.openai.tool_output import ToolOutput

    text = "<tool_call>x" + " " * (n * 8 * KIB) + "y"
    return lambda: ToolOutput("auto", NAMES).message(text, "stop")


def tool_output_streamed_a_character_at_a_time(n: int):
    """A streamed ``auto`` choice of n × 16 Ki one-character pieces: plain text, then an unclosed ``<tool_call>``."""
    from loraplex.openai.tool_output import ToolOutput

    pieces = ["a"] * (n * 8 * KIB) + list("<tool_call>") + ["b"] * (n * 8 * KIB)

    def run():
        out = ToolOutput("auto", NAMES)
        for piece in pieces:
            out.stream(0, piece, None)
        out.stream(0, "", "length")
    return run


def choice_text_tallied_in_deltas(n: int):
    """A choice's text of n × 2 Ki deltas of 256 characters (Tally.add), then the whole body's text."""
    from loraplex.openai.responses import Tally
    from loraplex.openai.triton_stream import Delta

    deltas = [Delta(["a" * 256], [1], [None], 3) for _ in range(n * 2 * KIB)]

    def run():
        tally = Tally(1, 1)
        for delta in deltas:
            tally.add(0, delta)
        return tally.texts
    return run


def test_tool_calls_with_a_whitespace_run_are_parsed_in_linear_time():
    assert_linear(tool_call_with_a_whitespace_run, 2, max_seconds=0.1)


def test_streamed_tool_output_costs_linear_time_in_its_pieces():
    assert_linear(tool_output_streamed_a_character_at_a_time, 2, max_seconds=0.5, repeats=1)


def test_a_choice_text_tallied_in_pieces_costs_linear_time():
    assert_linear(choice_text_tallied_in_deltas, 1, max_seconds=0.1, repeats=1)


# ---- error texts -------------------------------------------------------------------------------------------
def error_text_of_scheme_and_host_runs(n: int):
    """Messages of n × 1 KiB (the bound is 4 KiB) made of runs that every pattern could start in."""
    from loraplex.openai.errors import client_text

    texts = [(unit * (n * KIB))[:n * KIB - 1] for unit in ("a", "a.", "1a", "a-", ":")]
    return lambda: [client_text("[" + t) for t in texts]


def test_error_texts_are_redacted_in_linear_time():
    assert_linear(error_text_of_scheme_and_host_runs, 2, max_seconds=0.05)
