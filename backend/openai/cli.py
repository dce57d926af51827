"""``loraplex-openai``: run the OpenAI-compatible gateway (uvicorn) in front of a Triton server.

    loraplex-openai --triton-url localhost:8001 --port 9000 [--model-dir CHECKPOINT]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

from loraplex.openai.limits import (MAX_BODY_BYTES, MAX_CHOICES, MAX_MESSAGES, MAX_UPLOAD_BYTES, RENDER_QUEUE_PER_THREAD,
                                    RENDER_THREADS, RENDER_TIMEOUT_S, Limits)
from loraplex.openai.lora_api import ADMIN_KEY_ENV, LORA_ROOT_ENV
from loraplex.openai.process import GATEWAY_ID_ENV
from loraplex.openai.triton_stream import MAX_MESSAGE_BYTES

MODEL_DIR_ENV = "LORAPLEX_MODEL_DIR"
GRACEFUL_SHUTDOWN_SECONDS = 5  # open streams get this long after SIGTERM, then they are cut


def default_model_dir() -> str | None:
    """``$LORAPLEX_MODEL_DIR``, else the offline demo model if it is built."""
    if os.environ.get(MODEL_DIR_ENV):
        return os.environ[MODEL_DIR_ENV]
    from loraplex.launch.tritonserver import cache_dir

    demo = cache_dir() / "demo" / "model"
    return str(demo) if (demo / "config.json").is_file() else None


def context_length(model_dir: str) -> int | None:
    """The checkpoint's ``max_position_embeddings`` (config.json), if it says."""
    try:
        value = json.loads((Path(model_dir) / "config.json").read_text()).get("max_position_embeddings")
    except (OSError, ValueError):
        return None
    return value if isinstance(value, int) and value > 0 else None


def build_parser() -> argparse.ArgumentParser:
    """Command-line flags of loraplex-openai."""
    ap = argparse.ArgumentParser(prog="loraplex-openai", description=__doc__.split("\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--triton-url", default="localhost:8001", help="Triton gRPC address (host:port)")
    ap.add_argument("--host", default="127.0.0.1",
                    help="address the gateway binds to (0.0.0.0: every address; loraplex-serve passes its --address)")
    ap.add_argument("--port", type=int, default=9000, help="port the gateway listens on")
    ap.add_argument("--model-dir", default=None,
                    help=f"the checkpoint Triton serves (its tokenizer renders chat templates); default: "
                         f"${MODEL_DIR_ENV}, else the demo model in .cache/demo")
    ap.add_argument("--served-model-name", default=None,
                    help="id of the base model in /v1/models and `model` (default: the checkpoint's folder name)")
    ap.add_argument("--default-max-tokens", type=int, default=512,
                    help="max_tokens of a chat request that sets none (capped by the context left); "
                         "completions default to 16, as OpenAI's")
    ap.add_argument("--max-model-len", type=int, default=None,
                    help="context length used for that cap (default: config.json max_position_embeddings)")
    ap.add_argument("--lora-root", default=os.environ.get(LORA_ROOT_ENV) or None,
                    help=f"enables vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter (with the admin key "
                         f"${ADMIN_KEY_ENV}): a lora_path must resolve, symlinks followed, to a folder under this "
                         f"one; default ${LORA_ROOT_ENV}; unset: those routes answer 404")
    limits = ap.add_argument_group("limits", "what one request may cost the gateway (docs/openai.md, Limits)")
    limits.add_argument("--max-body-bytes", type=int, default=MAX_BODY_BYTES,
                        help="request bodies over this many bytes are refused with 413 while they are read")
    limits.add_argument("--max-upload-bytes", type=int, default=MAX_UPLOAD_BYTES,
                        help="an adapter upload's body (POST /v1/lora_adapters) and a lora_path's weights file; "
                             f"at most {MAX_MESSAGE_BYTES - 1024 * 1024} (one gRPC message to Triton)")
    limits.add_argument("--max-messages", type=int, default=MAX_MESSAGES,
                        help="chat messages per request (more: 400)")
    limits.add_argument("--max-choices", type=int, default=MAX_CHOICES,
                        help="prompts x n of one request (more: 400)")
    limits.add_argument("--render-threads", type=int, default=RENDER_THREADS,
                        help="threads that render chat templates and count prompt tokens (off the event loop); "
                             f"{RENDER_QUEUE_PER_THREAD} jobs per thread may wait, more get 503")
    limits.add_argument("--render-timeout", type=float, default=RENDER_TIMEOUT_S,
                        help="seconds a chat prompt may take to render, queueing included (over it: 503)")
    ap.add_argument("--log-level", default="info", help="uvicorn log level")
    return ap


def limits_from(args: argparse.Namespace) -> Limits:
    """The Limits the flags set; exits with a message when one is not positive."""
    values = {"max_body_bytes": args.max_body_bytes, "max_messages": args.max_messages,
              "max_choices": args.max_choices, "render_threads": args.render_threads,
              "render_timeout_s": args.render_timeout, "max_upload_bytes": args.max_upload_bytes}
    for name, value in values.items():
        if not value > 0:
            raise SystemExit(f"loraplex-openai: --{name.removesuffix('_s').replace('_', '-')} must be > 0")
    if args.max_upload_bytes > MAX_MESSAGE_BYTES - 1024 * 1024:
        raise SystemExit(f"loraplex-openai: --max-upload-bytes must be at most {MAX_MESSAGE_BYTES - 1024 * 1024}")
    return Limits(**values)


def main(argv: list[str] | None = None) -> int:
    """Entry point of loraplex-openai."""
    args = build_parser().parse_args(argv)
    model_dir = args.model_dir or default_model_dir()
    if model_dir is None and args.served_model_name is None:
        print(f"loraplex-openai: give --model-dir (or ${MODEL_DIR_ENV}) or --served-model-name", file=sys.stderr)
        return 2
    if model_dir is not None and not Path(model_dir).is_dir():
        print(f"loraplex-openai: --model-dir {model_dir}: not a directory", file=sys.stderr)
        return 2
    import uvicorn

    from loraplex.openai.app import Settings, create_app

    logging.basicConfig(level=args.log_level.upper(), format="loraplex-openai: %(message)s")
    settings = Settings(
        triton_url=args.triton_url,
        base_model=args.served_model_name or Path(model_dir).resolve().name,
        model_dir=str(Path(model_dir).resolve()) if model_dir else None,
        default_max_tokens=args.default_max_tokens,
        max_model_len=args.max_model_len or (context_length(model_dir) if model_dir else None),
        limits=limits_from(args),
        lora_root=str(Path(args.lora_root).resolve()) if args.lora_root else None,
        admin_key=os.environ.get(ADMIN_KEY_ENV) or None,
        gateway_id=os.environ.get(GATEWAY_ID_ENV) or None,
    )
    if args.lora_root and not Path(args.lora_root).is_dir():
        print(f"loraplex-openai: --lora-root {args.lora_root}: not a directory", file=sys.stderr)
        return 2
    if args.lora_root and not settings.admin_key:
        print(f"loraplex-openai: --lora-root is set but ${ADMIN_KEY_ENV} is not: /v1/load_lora_adapter and "
              f"/v1/unload_lora_adapter stay off (404)", file=sys.stderr)
    try:
        app = create_app(settings)
    except OSError as exc:
        print(f"loraplex-openai: cannot load the tokenizer of {model_dir}: {exc}", file=sys.stderr)
        return 2
    print(f"loraplex-openai: serving '{settings.base_model}' from Triton {settings.triton_url} "
          f"on http://{args.host}:{args.port}/v1", file=sys.stderr, flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level,
                timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_SECONDS)
    return 0


if __name__ == "__main__":
    sys.exit(main())
