"""Manage your LoRA adapters on a Loraplex server (`lora_adapters` model) with tritonclient (library + CLI).

    loraplex-adapters --api-key KEY upload ./my-adapter --name support
    loraplex-adapters --api-key KEY list
    loraplex-adapters --api-key KEY info support
    loraplex-adapters --api-key KEY delete support

The key comes from --api-key or $LORAPLEX_API_KEY (sent as the x-api-key header); on a
server without a tenants file (development mode) --tenant names the tenant instead.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np

from .identity import add_identity_arguments, identity_headers

MODEL = "lora_adapters"
CONFIG_FILE, WEIGHTS_FILE, PICKLE_FILE = "adapter_config.json", "adapter_model.safetensors", "adapter_model.bin"


def read_adapter_folder(folder: str | os.PathLike) -> tuple[str, bytes]:
    """(adapter_config.json text, adapter_model.safetensors bytes) of a PEFT folder; ValueError if it has no such pair."""
    root = Path(folder)
    if not root.is_dir():
        raise ValueError(f"{root}: not a directory")
    config, weights = root / CONFIG_FILE, root / WEIGHTS_FILE
    if not weights.is_file():
        if (root / PICKLE_FILE).is_file():
            load = f"torch.load('{root / PICKLE_FILE}', weights_only=True)"  # tensors only, never arbitrary objects
            raise ValueError(
                f"{root} holds only {PICKLE_FILE} (a pickle); the server refuses pickle files. Convert it first:\n"
                f"  python -c \"import torch; from safetensors.torch import save_file; save_file({load}, '{weights}')\""
            )
        raise ValueError(f"{root}: missing {WEIGHTS_FILE}")
    if not config.is_file():
        raise ValueError(f"{root}: missing {CONFIG_FILE}")
    return config.read_text(encoding="utf-8"), weights.read_bytes()


def _client_module(protocol: str):
    if protocol == "grpc":
        import tritonclient.grpc as module
    elif protocol == "http":
        import tritonclient.http as module
    else:
        raise ValueError(f"protocol must be 'grpc' or 'http', got {protocol!r}")
    return module


def build_inputs(module, action: str, name: str | None = None, config_text: str | None = None,
                 weights: bytes | None = None, cursor: str | None = None, limit: int | None = None) -> list:
    """The `lora_adapters` input tensors (STRING/BYTES [1] each) for one action."""
    inputs = []
    for input_name, value in (("action", action), ("adapter_name", name), ("adapter_config", config_text),
                              ("adapter_weights", weights), ("cursor", cursor),
                              ("limit", None if limit is None else str(limit))):
        if value is None:
            continue
        raw = value.encode("utf-8") if isinstance(value, str) else bytes(value)
        tensor = module.InferInput(input_name, [1], "BYTES")
        tensor.set_data_from_numpy(np.array([raw], dtype=np.object_))
        inputs.append(tensor)
    return inputs


def adapter_request(url: str, action: str, name: str | None = None, config_text: str | None = None,
                    weights: bytes | None = None, headers: dict | None = None, protocol: str = "grpc",
                    timeout: float = 120.0, cursor: str | None = None, limit: int | None = None) -> dict:
    """One `lora_adapters` request: its `result` JSON; raises tritonclient's InferenceServerException on an error."""
    module = _client_module(protocol)
    client = module.InferenceServerClient(url, **({"network_timeout": timeout} if protocol == "http" else {}))
    try:
        inputs = build_inputs(module, action, name, config_text, weights, cursor, limit)
        outputs = [module.InferRequestedOutput("result")]
        kwargs = {"client_timeout": timeout} if protocol == "grpc" else {}
        result = client.infer(MODEL, inputs, outputs=outputs, headers=headers, **kwargs)
        raw = result.as_numpy("result").reshape(-1)[0]
        return json.loads(raw.decode("utf-8") if isinstance(raw, bytes) else raw)
    finally:
        client.close()


def upload_adapter(url: str, name: str, folder: str | os.PathLike, **kw) -> dict:
    """Upload the PEFT folder as the caller's adapter `name` (replacing its current version); its info."""
    config_text, weights = read_adapter_folder(folder)
    return adapter_request(url, "upload", name, config_text, weights, **kw)


def list_adapters(url: str, max_pages: int = 1000, **kw) -> list[dict]:
    """The caller's adapters, sorted by name (every page of the paginated list, up to ``max_pages``)."""
    found, cursor = [], None
    for _ in range(max_pages):
        result = adapter_request(url, "list", cursor=cursor, **kw)
        found += result["adapters"]
        cursor = result.get("next")
        if cursor is None:
            break
    return found


def adapter_info(url: str, name: str, **kw) -> dict:
    """The caller's adapter `name`: version, rank, target modules, bytes, digest, created."""
    return adapter_request(url, "info", name, **kw)


def delete_adapter(url: str, name: str, **kw) -> dict:
    """Delete the caller's adapter `name`; the info of what was deleted."""
    return adapter_request(url, "delete", name, **kw)


def _error_text(exc: Exception) -> str:
    message = getattr(exc, "message", None)
    return message() if callable(message) else str(exc)


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point (`loraplex-adapters`)."""
    ap = argparse.ArgumentParser(prog="loraplex-adapters", description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="\n".join(__doc__.split("\n")[2:]))
    ap.add_argument("--url", default=None, help="Triton address (default localhost:8001 for grpc, "
                                                "localhost:8000 for http)")
    ap.add_argument("--protocol", choices=("grpc", "http"), default="grpc", help="default grpc")
    add_identity_arguments(ap)
    commands = ap.add_subparsers(dest="command", required=True)
    up = commands.add_parser("upload", help="upload a PEFT folder (adapter_config.json + adapter_model.safetensors)")
    up.add_argument("folder")
    up.add_argument("--name", required=True, help="adapter name (1-64 letters, digits, '.', '_', '-')")
    commands.add_parser("list", help="list your adapters")
    for command, text in (("info", "show one adapter"), ("delete", "delete one adapter")):
        commands.add_parser(command, help=text).add_argument("name")
    args = ap.parse_args(argv)
    url = args.url or ("localhost:8001" if args.protocol == "grpc" else "localhost:8000")
    kw = {"headers": identity_headers(args.api_key, args.tenant), "protocol": args.protocol}
    try:
        if args.command == "upload":
            result = upload_adapter(url, args.name, args.folder, **kw)
        elif args.command == "list":
            result = {"adapters": list_adapters(url, **kw)}
        elif args.command == "info":
            result = adapter_info(url, args.name, **kw)
        else:
            result = delete_adapter(url, args.name, **kw)
    except ValueError as exc:  # a local problem (the folder)
        print(f"loraplex-adapters: {exc}", file=sys.stderr)
        return 1
    except Exception as exc:  # noqa: BLE001 - tritonclient's InferenceServerException and connection errors
        print(f"loraplex-adapters: error: {_error_text(exc)}", file=sys.stderr)
        return 1
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
