"""Error responses: what a client may read (codes and texts), and what stays in the server log."""

import logging

import pytest

from loraplex.exceptions import AdapterNotFound, EngineOverloaded, InvalidRequest, RequestCancelled
from loraplex.triton.errors import INTERNAL_TEXT, client_error
from loraplex.triton.responder import Responder

FINAL = 1


class Codes:
    INVALID_ARG, NOT_FOUND, UNAVAILABLE, CANCELLED, INTERNAL = "INVALID_ARG", "NOT_FOUND", "UNAVAILABLE", \
        "CANCELLED", "INTERNAL"


class FakePb:
    TRITONSERVER_RESPONSE_COMPLETE_FINAL = FINAL

    class TritonError(Codes):
        def __init__(self, message, code):
            self.message, self.code = message, code

    class InferenceResponse:
        def __init__(self, output_tensors, error=None):
            self.error = error


@pytest.mark.parametrize("exc, code", [
    (InvalidRequest("max_tokens must be >= 1"), "INVALID_ARG"),
    (AdapterNotFound("LoRA x is not supported"), "NOT_FOUND"),
    (EngineOverloaded("server overloaded; retry later"), "UNAVAILABLE"),
    (RequestCancelled("cancelled"), "CANCELLED"),
])
def test_errors_made_for_the_client_keep_their_text(exc, code):
    assert client_error(FakePb, exc) == (exc.args[0], code)  # a KeyError's text unquoted


def test_an_internal_error_reaches_the_client_as_a_generic_text_and_the_log_has_the_details(caplog):
    leak = RuntimeError("open('/srv/models/secret/weights.bin') failed: <object at 0x7f00>")
    with caplog.at_level(logging.ERROR, logger="loraplex.triton"):
        message, code = client_error(FakePb, leak, "17:abc")
    assert (message, code) == (INTERNAL_TEXT.format(ref="17:abc"), "INTERNAL")
    assert "/srv/models" not in message and "0x7f00" not in message
    (record,) = caplog.records
    assert "17:abc" in record.getMessage() and record.exc_info[1] is leak
    message, _ = client_error(FakePb, leak)  # no request id yet: a fresh reference, the same in the log
    ref = message.split("request ")[1].split(")")[0]
    assert len(ref) == 16 and ref in caplog.records[-1].getMessage()


def test_the_responder_sends_an_engine_failure_generically_with_its_request_id():
    class Sender:
        sent = []

        def send(self, response, flags=0):
            self.sent.append((response.error.message, response.error.code, flags))

    responder = Responder(FakePb, abort=lambda _: None, decode_token=str)
    sender = Sender()
    responder.send_exception(sender, KeyError("/tmp/internal"), "5:r")
    assert sender.sent == [(INTERNAL_TEXT.format(ref="5:r"), "INTERNAL", FINAL)]
