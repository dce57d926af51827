"""The gateway's LoRA API, pure parts: lora_path stays under --lora-root (symlinks resolved), the admin key,
bounded file reads, the multipart upload parser."""

from __future__ import annotations

import os

import pytest

from loraplex.openai.errors import OpenAIError
from loraplex.openai.lora_api import (MAX_CONFIG_BYTES, check_admin, multipart_fields, read_adapter_files,
                                      resolve_under, upload_fields, upload_parts, upload_reader)
from loraplex.openai.multipart import MAX_PART_HEADER_BYTES, MAX_PARTS, MultipartReader, parameters


@pytest.fixture
def root(tmp_path):
    root = tmp_path / "loras"
    (root / "sql").mkdir(parents=True)
    (root / "sql" / "adapter_config.json").write_text("{}")
    (root / "sql" / "adapter_model.safetensors").write_bytes(b"w" * 100)
    outside = tmp_path / "secret"
    outside.mkdir()
    (outside / "adapter_config.json").write_text("{}")
    (outside / "adapter_model.safetensors").write_bytes(b"s")
    return root


def status(call, *args) -> tuple[int, str]:
    with pytest.raises(OpenAIError) as err:
        call(*args)
    return err.value.status, err.value.message


def test_lora_path_must_resolve_under_the_root(root, tmp_path):
    assert resolve_under(str(root), str(root / "sql")) == root / "sql"
    assert resolve_under(str(root), "sql") == root / "sql"  # relative: to the root
    (root / "escape").symlink_to(tmp_path / "secret")
    for path in ("../secret", str(tmp_path / "secret"), "escape", "sql/../../secret", "/etc"):
        code, message = status(resolve_under, str(root), path)
        assert code == 400 and "not under the gateway's --lora-root" in message
        assert str(root) not in message.replace(path, "")  # names the path as given, never a resolved one
    assert "secret" not in status(resolve_under, str(root), "escape")[1]
    assert status(resolve_under, str(root), "nothing")[0] == 400
    assert status(resolve_under, str(root), "sql\0x")[0] == 400


def test_files_linked_out_of_the_root_and_oversized_files_are_refused(root, tmp_path):
    assert read_adapter_files(root / "sql", str(root), 1000) == (b"{}", b"w" * 100)
    assert "at most 99" in status(read_adapter_files, root / "sql", str(root), 99)[1]
    (root / "linked").mkdir()
    os.symlink(tmp_path / "secret" / "adapter_config.json", root / "linked" / "adapter_config.json")
    (root / "linked" / "adapter_model.safetensors").write_bytes(b"w")
    assert "link out of the gateway's --lora-root" in status(read_adapter_files, root / "linked", str(root), 10)[1]
    (root / "big").mkdir()
    (root / "big" / "adapter_config.json").write_bytes(b" " * (MAX_CONFIG_BYTES + 1))
    assert status(read_adapter_files, root / "big", str(root), 10)[0] == 400
    (root / "half").mkdir()
    (root / "half" / "adapter_config.json").write_text("{}")
    assert "has no adapter_model.safetensors" in status(read_adapter_files, root / "half", str(root), 10)[1]


def test_the_admin_key_is_required(root):
    assert check_admin({"x-loraplex-admin-key": "k"}, "k") == "k"
    assert check_admin({"authorization": "Bearer k"}, "k") == "k"
    for headers in ({}, {"authorization": "Bearer nope"}, {"x-loraplex-admin-key": "nope", "authorization": "Bearer k"}):
        assert status(check_admin, headers, "k")[0] == 401


def form(*parts: tuple[str, bytes], boundary: str = "XyZ") -> tuple[str, bytes]:
    body = b"".join(f'--{boundary}\r\nContent-Disposition: form-data; name="{n}"; filename="{n}.bin"\r\n'
                    f"Content-Type: application/octet-stream\r\n\r\n".encode() + v + b"\r\n" for n, v in parts)
    return f"multipart/form-data; boundary={boundary}", body + f"--{boundary}--\r\n".encode()


def test_multipart_upload_fields():
    weights = b"\r\n--Xy not the boundary\r\n\x00\xff" * 3
    ctype, body = form(("name", b"support"), ("adapter_config", b'{"r": 4}'), ("adapter_model", weights))
    assert upload_parts(multipart_fields(ctype, body)) == ("support", '{"r": 4}', weights)
    assert status(upload_parts, multipart_fields(*form(("name", b"x"))))[1].startswith("the upload needs")
    assert "unknown multipart" in status(upload_parts, multipart_fields(*form(
        ("name", b"x"), ("adapter_config", b"{}"), ("adapter_model", b"w"), ("extra", b""))))[1]
    assert "given twice" in status(multipart_fields, *form(("name", b"a"), ("name", b"b")))[1]
    assert "more than 8 parts" in status(multipart_fields, *form(*[(f"f{i}", b"") for i in range(20)]))[1]
    assert "not terminated" in status(multipart_fields, ctype, body[:-10])[1]
    assert "multipart/form-data" in status(multipart_fields, "application/json", body)[1]
    assert "no boundary" in status(multipart_fields, "multipart/form-data", body)[1]
    assert "over 70" in status(multipart_fields, "multipart/form-data; boundary=" + "b" * 71, body)[1]


def test_multipart_read_byte_by_byte_equals_read_whole():
    weights = bytes(range(256)) * 8 + b"\r\n--XyY\r\n--Xy"  # near misses of the delimiter
    ctype, body = form(("name", b"support"), ("adapter_config", b'{"r": 4}'), ("adapter_model", weights))
    reader = upload_reader(ctype, 1 << 20)
    for i in range(len(body)):
        reader.feed(body[i:i + 1])
    assert reader.close() == multipart_fields(ctype, body) == {"name": b"support", "adapter_config": b'{"r": 4}',
                                                               "adapter_model": weights}
    padded = body.replace(b"--XyZ\r\n", b"--XyZ \t\r\n", 1)  # RFC 2046 transport padding
    assert multipart_fields(ctype, b"preamble\r\n" + padded + b"epilogue")["name"] == b"support"


def test_multipart_bounds_are_checked_while_reading():
    ctype = "multipart/form-data; boundary=XyZ"
    reader = upload_reader(ctype, 1 << 20)
    head = b"\r\nContent-Disposition: form-data; "  # a part's header block starts after its boundary
    reader.feed(b"--XyZ" + head + b"a" * (MAX_PART_HEADER_BYTES - len(head)))  # at the bound: still read
    with pytest.raises(OpenAIError, match=f"headers are over {MAX_PART_HEADER_BYTES} bytes"):
        reader.feed(b"a" * 4)
    tiny = b"".join(b'--XyZ\r\nContent-Disposition: form-data; name="f%d"\r\n\r\n\r\n' % i for i in range(10))
    many = MultipartReader(b"XyZ")
    with pytest.raises(OpenAIError, match="more than 8 parts"):
        many.feed(tiny + b"x" * (1 << 20))
    assert many.parts == MAX_PARTS + 1
    with pytest.raises(OpenAIError, match="before its first boundary"):
        MultipartReader(b"XyZ").feed(b"p" * (MAX_PART_HEADER_BYTES + 100))
    with pytest.raises(OpenAIError, match="unknown multipart field 'extra'") as unknown:
        upload_reader(ctype, 100).feed(b'--XyZ\r\nContent-Disposition: form-data; name="extra"\r\n\r\n')
    assert unknown.value.param == "extra"
    big = upload_reader(ctype, 100)
    big.feed(b'--XyZ\r\nContent-Disposition: form-data; name="adapter_model"\r\n\r\n' + b"w" * 100)
    with pytest.raises(OpenAIError, match="'adapter_model' is over 100 bytes"):
        big.feed(b"w" * 100)
    assert upload_fields(100) == {"name": 256, "adapter_config": MAX_CONFIG_BYTES, "adapter_model": 100}
    for bad in (b"--XyZ\r\n\r\nno headers", b"--XyZ\r\nContent-Disposition: attachment; name=a\r\n\r\n",
                b"--XyZ\r\nno colon\r\n\r\n", b"--XyZjunk\r\nContent-Disposition: form-data; name=a\r\n\r\n"):
        with pytest.raises(OpenAIError):
            MultipartReader(b"XyZ").feed(bad)


def test_header_parameters_are_read_in_one_pass():
    assert parameters(' name="a\\"b;c"; filename=x.bin ;flag; NAME=ignored') == {"name": 'a"b;c', "filename": "x.bin"}
    assert parameters("a" * 100_000) == {} and parameters('name="unterminated') == {"name": "unterminated"}
    assert parameters(" boundary = ----x ") == {"boundary": "----x"}
