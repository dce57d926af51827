"""vLLM's LoRA API on the gateway (``/v1/load_lora_adapter``, ``/v1/unload_lora_adapter``) and a tenant's upload
over HTTP (``POST /v1/lora_adapters``, multipart): the pure parts, checked before Triton is called.

Loading is the operator's: it needs the admin key (``x-loraplex-admin-key``, or ``Authorization: Bearer``),
compared here in constant time and again by lora_adapters, and a ``lora_path`` that resolves (symlinks
followed) to a folder under ``--lora-root``; the two files are read from there with bounded sizes and
sent to lora_adapters, which validates them exactly as an upload and stores a new shared version.

A tenant's upload is read only after its key passed (the route asks Triton first), and then as it
arrives, through multipart.py's streaming reader with this module's field policy: ``name``,
``adapter_config`` and ``adapter_model``, each refused past its size while it is read.
"""

from __future__ import annotations

import hmac
import os
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from loraplex.openai.errors import OpenAIError, bad_request
from loraplex.openai.multipart import MultipartReader, boundary_of

ADMIN_HEADER = "x-loraplex-admin-key"
ADMIN_KEY_ENV = "LORAPLEX_ADMIN_KEY"
LORA_ROOT_ENV = "LORAPLEX_LORA_ROOT"
CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
MAX_CONFIG_BYTES = 64 * 1024  # loraplex.lora.store.MAX_CONFIG_BYTES
FEED_BYTES = 64 * 1024  # multipart_fields' chunks
MAX_NAME_BYTES = 256  # the name field (adapter names are at most 64 characters)


class LoadLoraAdapterRequest(BaseModel):
    """vLLM's body of /v1/load_lora_adapter."""

    model_config = ConfigDict(extra="ignore")
    lora_name: str = Field(min_length=1, max_length=64)
    lora_path: str = Field(min_length=1, max_length=4096)
    load_inplace: bool = False


class UnloadLoraAdapterRequest(BaseModel):
    """vLLM's body of /v1/unload_lora_adapter (``lora_int_id`` accepted and ignored)."""

    model_config = ConfigDict(extra="ignore")
    lora_name: str = Field(min_length=1, max_length=64)
    lora_int_id: int | None = None


def not_enabled(path: str) -> OpenAIError:
    """404, as vLLM answers when runtime LoRA updating is off."""
    return OpenAIError(404, f"{path} is not enabled on this gateway (start it with --lora-root and an admin key)",
                       "not_found_error", None, "not_enabled")


def given_admin_key(headers) -> str | None:
    """The admin key a request carries: ``x-loraplex-admin-key``, else ``Authorization: Bearer``."""
    if headers.get(ADMIN_HEADER):
        return headers[ADMIN_HEADER].strip()
    scheme, _, key = headers.get("authorization", "").partition(" ")
    return key.strip() if scheme.lower() == "bearer" and key.strip() else None


def check_admin(headers, expected: str) -> str:
    """The request's admin key if it is ``expected`` (constant time); 401 otherwise."""
    given = given_admin_key(headers)
    if given is None or not hmac.compare_digest(given.encode("utf-8", "surrogatepass"),
                                                expected.encode("utf-8", "surrogatepass")):
        raise OpenAIError(401, "missing or invalid admin key (send it as the x-loraplex-admin-key header or "
                               "Authorization: Bearer)", "invalid_request_error", None, "invalid_api_key")
    return given


def resolve_under(root: str, lora_path: str) -> Path:
    """``lora_path`` (relative paths: to ``root``) with every symlink resolved, if it is a folder under ``root``'s
    real path; 400 otherwise, naming neither real path."""
    base = Path(os.path.realpath(root))
    if "\0" in lora_path:
        raise bad_request("lora_path must not contain NUL", "lora_path")
    target = Path(os.path.realpath(base / lora_path))
    if target != base and base not in target.parents:
        raise bad_request(f"lora_path {lora_path[:200]!r} is not under the gateway's --lora-root", "lora_path")
    if not target.is_dir():
        raise bad_request(f"lora_path {lora_path[:200]!r} is not a folder under the gateway's --lora-root",
                          "lora_path")
    return target


def read_adapter_files(folder: Path, root: str, max_bytes: int) -> tuple[bytes, bytes]:
    """(adapter_config.json, adapter_model.safetensors) of a folder resolved under ``root``: each file's real
    path must stay under it too, and their sizes under the bounds (checked before reading)."""
    base = Path(os.path.realpath(root))
    files = []
    for name, limit in ((CONFIG_FILE, MAX_CONFIG_BYTES), (WEIGHTS_FILE, max_bytes)):
        path = Path(os.path.realpath(folder / name))
        if base not in path.parents:
            raise bad_request(f"{name} of lora_path is a link out of the gateway's --lora-root", "lora_path")
        try:
            with open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                if size > limit:
                    raise bad_request(f"{name} of lora_path is {size} bytes; at most {limit} are allowed",
                                      "lora_path")
                files.append(f.read(limit + 1)[:limit + 1])
        except (FileNotFoundError, IsADirectoryError):
            raise bad_request(f"lora_path has no {name}", "lora_path") from None
        except PermissionError:
            raise bad_request(f"{name} of lora_path is not readable by the gateway", "lora_path") from None
        if len(files[-1]) > limit:
            raise bad_request(f"{name} of lora_path grew past {limit} bytes while it was read", "lora_path")
    return files[0], files[1]


def upload_fields(max_upload_bytes: int) -> dict[str, int]:
    """An upload's multipart fields and the most bytes each may hold."""
    return {"name": MAX_NAME_BYTES, "adapter_config": MAX_CONFIG_BYTES, "adapter_model": max_upload_bytes}


def upload_reader(content_type: str, max_upload_bytes: int) -> MultipartReader:
    """The streaming reader of an upload's body (400 for a Content-Type that is not multipart/form-data)."""
    return MultipartReader(boundary_of(content_type), upload_fields(max_upload_bytes))


def multipart_fields(content_type: str, body: bytes, fields: dict[str, int] | None = None) -> dict[str, bytes]:
    """The named parts of a whole multipart/form-data body (``fields``: the reader's policy); 400 if malformed. It
    is fed in FEED_BYTES chunks, as a server reads a body, so a refusal stops it early."""
    reader, view = MultipartReader(boundary_of(content_type), fields), memoryview(body)
    for at in range(0, len(body), FEED_BYTES):
        reader.feed(view[at:at + FEED_BYTES])
    return reader.close()


def upload_parts(fields: dict[str, bytes]) -> tuple[str, str, bytes]:
    """(name, adapter_config.json text, adapter_model.safetensors bytes) of an upload's fields; 400 if one is
    missing or extra."""
    expected = ("name", "adapter_config", "adapter_model")
    missing = [f for f in expected if f not in fields]
    if missing:
        raise bad_request(f"the upload needs the multipart field(s) {', '.join(missing)}", missing[0])
    extra = sorted(f for f in fields if f not in expected)
    if extra:
        raise bad_request(f"unknown multipart field(s) {', '.join(n[:40] for n in extra)}", extra[0][:40])
    try:
        name = fields["name"].decode("utf-8").strip()
        config = fields["adapter_config"].decode("utf-8")
    except UnicodeDecodeError:
        raise bad_request("name and adapter_config must be UTF-8 text") from None
    if len(fields["adapter_config"]) > MAX_CONFIG_BYTES:
        raise bad_request(f"adapter_config is over {MAX_CONFIG_BYTES} bytes", "adapter_config")
    return name, config, fields["adapter_model"]
