"""A JSON request body, parsed and validated against the gateway's Limits: 400 naming the first bad field.

It runs on the event loop, after the body was read within its bound (intake.py) and, for a large
body, after the caller's key passed (app.parse_body): its cost is linear in the body (stop, stop_token_ids,
logit_bias, messages and prompts are counted before their items are validated, protocol.py).
"""

from __future__ import annotations

import json
from typing import TypeVar

from pydantic import BaseModel, ValidationError

from loraplex.openai.errors import bad_request
from loraplex.openai.limits import Limits

Body = TypeVar("Body", bound=BaseModel)


def validation_message(errors: list) -> tuple[str, str | None]:
    """(message, param) for the first of pydantic's errors."""
    if not errors:
        return "invalid request body", None
    first = errors[0]
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    where = ".".join(loc)
    return (f"{where}: {first.get('msg')}" if where else str(first.get("msg"))), (loc[0] if loc else None)


def parse_json(raw: bytes, model: type[Body], limits: Limits) -> Body:
    """A JSON body as ``model``, checked against ``limits``; 400 naming the first bad field."""
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError):
        raise bad_request("the body is not valid JSON") from None
    if not isinstance(data, dict):
        raise bad_request("the body must be a JSON object")
    try:
        return model.model_validate(data, context=limits)
    except ValidationError as exc:
        raise bad_request(*validation_message(exc.errors())) from None


