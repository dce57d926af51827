"""A streaming multipart/form-data reader: linear in the body, fed chunk by chunk, bounded as it reads.

No regular expression and no split of the whole body: delimiters and header ends are found with
``bytes.find`` over each new chunk (plus the few bytes a delimiter may straddle), header parameters
by one left-to-right scan. A part's header block is refused past ``max_header_bytes``, the bytes
before the first delimiter past the same bound, the parts are counted as each one starts (the
``max_parts + 1``-th is refused before it is read), and with a field policy an unknown or repeated
field is refused at its header and a field over its size while it is read. Each ``feed`` costs
O(len(chunk) + len(boundary)), so the event loop can feed it as the body arrives.
"""

from __future__ import annotations

from loraplex.openai.errors import bad_request

MAX_PARTS = 8  # parts of one body
MAX_PART_HEADER_BYTES = 8 * 1024  # one part's header block (all its lines); also the bytes before the first part
MAX_BOUNDARY = 70  # RFC 2046's longest boundary

_PREAMBLE, _BODY, _AFTER_DELIMITER, _HEADERS, _END = range(5)


def parameters(text: str) -> dict[str, str]:
    """The ``key=value`` parameters of a header value after its first ``;`` (keys lower-cased, the first of a
    repeated key kept, quoted values unescaped, bare tokens without ``=`` skipped): one pass over ``text``."""
    out: dict[str, str] = {}
    i, n = 0, len(text)
    while i < n:
        j = i
        while j < n and text[j] != "=" and text[j] != ";":
            j += 1
        key = text[i:j].strip().lower()
        if j >= n or text[j] == ";":
            i = j + 1
            continue
        j += 1
        while j < n and text[j] in " \t":
            j += 1
        if j < n and text[j] == '"':
            j, chars = j + 1, []
            while j < n and text[j] != '"':
                if text[j] == "\\" and j + 1 < n:
                    j += 1
                chars.append(text[j])
                j += 1
            value = "".join(chars)
            while j < n and text[j] != ";":
                j += 1
        else:
            start = j
            while j < n and text[j] != ";":
                j += 1
            value = text[start:j].strip()
        if key and key not in out:
            out[key] = value
        i = j + 1
    return out


def boundary_of(content_type: str) -> bytes:
    """The boundary of a ``multipart/form-data`` Content-Type; 400 for another type or a missing or long one."""
    kind, _, params = content_type.partition(";")
    if kind.strip().lower() != "multipart/form-data":
        raise bad_request("the upload must be multipart/form-data (fields name, adapter_config, adapter_model)")
    boundary = parameters(params).get("boundary", "")
    if not boundary:
        raise bad_request("the multipart body has no boundary")
    if len(boundary) > MAX_BOUNDARY:
        raise bad_request(f"the multipart boundary is over {MAX_BOUNDARY} characters")
    try:
        return boundary.encode("ascii")
    except UnicodeEncodeError:
        raise bad_request("the multipart boundary must be ASCII") from None


class MultipartReader:
    """One body's named parts, read as its chunks arrive (``feed``) and returned by ``close``.

    ``fields`` (name -> most bytes), when given, is the policy: other names are refused at their header.
    """

    def __init__(self, boundary: bytes, fields: dict[str, int] | None = None, max_parts: int = MAX_PARTS,
                 max_header_bytes: int = MAX_PART_HEADER_BYTES):
        self.fields, self.max_parts, self.max_header_bytes = fields, max_parts, max_header_bytes
        self._delimiter = b"\r\n--" + boundary
        self._buffer = bytearray(b"\r\n")  # a first delimiter at the very start has no CRLF before it
        self._state, self._scanned, self._preamble = _PREAMBLE, 0, -2
        self._name: str | None = None
        self._pieces: list[bytearray] = []
        self._size = 0
        self.parts = 0
        self.values: dict[str, bytes] = {}

    def feed(self, chunk: bytes | bytearray | memoryview) -> None:
        """Read the next bytes of the body; 400 as soon as a bound is passed or the form is malformed."""
        if self._state == _END:
            return  # the epilogue is ignored
        self._buffer += chunk
        while self._step():
            pass

    def close(self) -> dict[str, bytes]:
        """The parts' values by name, once the body ended; 400 unless its closing delimiter was read."""
        if self._state != _END:
            raise bad_request("the multipart body is not terminated by its boundary")
        return self.values

    def _step(self) -> bool:
        """Advance over the buffer as far as one state allows; whether another step may advance further."""
        if self._state in (_PREAMBLE, _BODY):
            return self._to_delimiter()
        if self._state == _AFTER_DELIMITER:
            return self._after_delimiter()
        return self._headers()

    def _to_delimiter(self) -> bool:
        buffer, delimiter = self._buffer, self._delimiter
        at = buffer.find(delimiter)
        end = at if at >= 0 else max(0, len(buffer) - len(delimiter) + 1)  # a delimiter may straddle chunks
        if self._state == _BODY:
            self._take(buffer[:end])
        else:
            self._preamble += end
            if self._preamble > self.max_header_bytes:
                raise bad_request(f"the multipart body has over {self.max_header_bytes} bytes before its first "
                                  "boundary")
        del buffer[:end]
        if at < 0:
            return False
        del buffer[:len(delimiter)]
        if self._state == _BODY:
            self.values[self._name] = b"".join(self._pieces)
            self._pieces, self._size = [], 0
        self._state = _AFTER_DELIMITER
        return True

    def _after_delimiter(self) -> bool:
        if len(self._buffer) < 2:
            return False
        if self._buffer[:2] == b"--":
            self._state = _END
            self._buffer.clear()
            return False
        self.parts += 1
        if self.parts > self.max_parts:
            raise bad_request(f"the multipart body has more than {self.max_parts} parts")
        self._state, self._scanned = _HEADERS, 0
        return True

    def _headers(self) -> bool:
        buffer = self._buffer
        at = buffer.find(b"\r\n\r\n", max(0, self._scanned - 3))
        if at < 0 or at > self.max_header_bytes:
            if at > self.max_header_bytes or len(buffer) > self.max_header_bytes + 3:
                raise bad_request(f"a multipart part's headers are over {self.max_header_bytes} bytes")
            self._scanned = len(buffer)
            return False
        block = bytes(buffer[:at]).decode("latin-1")
        del buffer[:at + 4]
        self._start_part(block)
        self._state = _BODY
        return True

    def _start_part(self, block: str) -> None:
        """Check a part's header block (the rest of its delimiter line, then its header lines) and name it."""
        padding, *lines = block.split("\r\n")
        if padding.strip(" \t"):
            raise bad_request("a multipart boundary line has text after the boundary")
        disposition = None
        for line in lines:
            key, sep, value = line.partition(":")
            if not sep:
                raise bad_request("a multipart part has a header line without ':'")
            if key.strip().lower() == "content-disposition" and disposition is None:
                disposition = value
        kind, _, params = (disposition or "").partition(";")
        name = parameters(params).get("name") if kind.strip().lower() == "form-data" else None
        if not name:
            raise bad_request("a multipart part has no name (Content-Disposition: form-data; name=...)")
        if name in self.values:
            raise bad_request(f"the multipart field {name[:40]!r} is given twice", name[:40])
        if self.fields is not None and name not in self.fields:
            raise bad_request(f"unknown multipart field {name[:40]!r} (expected {', '.join(self.fields)})",
                              name[:40])
        self._name = name

    def _take(self, data: bytearray) -> None:
        if not data:
            return
        self._size += len(data)
        limit = self.fields.get(self._name) if self.fields is not None else None
        if limit is not None and self._size > limit:
            raise bad_request(f"the multipart field {self._name!r} is over {limit} bytes", self._name)
        self._pieces.append(data)
