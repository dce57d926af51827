"""A neighbour's greedy stream beside each hostile request of docs/security.md's inventory, through a real server.

Starts ``loraplex-serve`` (SmolLM2, a tenants file of two tenants, the OpenAI gateway), then for each attack: the
good tenant's greedy chat of ``--tokens`` tokens (streamed, ``ignore_eos``) alone and while the attack runs, and
another caller's ``GET /v1/models`` polled every 0.1 s meanwhile. The attack is sent once, 0.3 s into the
neighbour's stream (``--flood``: again each time it ends, for as long as the neighbour runs). Prints one row per
attack: the neighbour's time alone just before and beside the attack, their ratio (issue 39's goal: at most 1.5),
the slowest gateway answer (goal: under 1 s), how many attacks were sent, the longest, and how the last ended.

Usage: .venv/bin/python benchmarks/hostile_served.py [--attacks name,...] [--port 18300] [--tokens 64] [--flood]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import requests

ROOT = Path(__file__).resolve().parents[1]
KEYS = {"good": "good-key-" + "0" * 24, "mallory": "mallory-key-" + "1" * 24}
MESSAGES = [{"role": "user", "content": "Tell me about the sea."}]
AMBIGUOUS_GRAMMAR = 'root ::= x\nx ::= x x | "a" | "b" | ""'


def _multipart(parts: list[tuple[bytes, bytes]], boundary: bytes = b"loraplexboundary") -> tuple[str, bytes]:
    """(content type, body) of raw (part header, content) pairs."""
    body = b"".join(b"--" + boundary + b"\r\n" + head + b"\r\n\r\n" + content + b"\r\n" for head, content in parts)
    return f"multipart/form-data; boundary={boundary.decode()}", body + b"--" + boundary + b"--\r\n"


def _adapter_files(config_changes: dict) -> tuple[bytes, bytes]:
    folder = ROOT / "demo_adapters" / "pirate"
    config = json.loads((folder / "adapter_config.json").read_text())
    config.update(config_changes)
    return json.dumps(config).encode(), (folder / "adapter_model.safetensors").read_bytes()


def _upload(gateway: str, name: str, config: bytes, weights: bytes, key: str | None) -> requests.Response:
    content_type, body = _multipart([(b'Content-Disposition: form-data; name="name"', name.encode()),
                                     (b'Content-Disposition: form-data; name="adapter_config"', config),
                                     (b'Content-Disposition: form-data; name="adapter_model"', weights)])
    headers = {"content-type": content_type, **({"authorization": f"Bearer {key}"} if key else {})}
    return requests.post(f"{gateway}/v1/lora_adapters", data=body, headers=headers, timeout=600)


def _chat(gateway: str, key: str, timeout: float = 600, **fields) -> requests.Response:
    body = {"model": "base", "messages": MESSAGES, "max_tokens": 16, "temperature": 0, **fields}
    return requests.post(f"{gateway}/v1/chat/completions", json=body, timeout=timeout,
                         headers={"authorization": f"Bearer {key}"})


def _outcome(response: requests.Response) -> str:
    try:
        message = response.json().get("error", {}).get("message", "")
    except ValueError:
        message = response.text
    return f"{response.status_code} {message[:90]}".strip()


def attack_multipart_part_header(urls: dict) -> str:
    """No key; one part header of 1 MiB with no '=' (the old parser: quadratic, on the event loop)."""
    head = b"Content-Disposition: form-data; " + b"a" * (1 << 20)
    content_type, body = _multipart([(head, b"x")])
    return _outcome(requests.post(f"{urls['gateway']}/v1/lora_adapters", data=body, timeout=600,
                                  headers={"content-type": content_type}))


def attack_multipart_many_parts(urls: dict) -> str:
    """A tenant's 40 MiB body of one-byte parts."""
    content_type, body = _multipart([(b'Content-Disposition: form-data; name="p"', b"x")] * 800_000)
    return _outcome(requests.post(f"{urls['gateway']}/v1/lora_adapters", data=body, timeout=600,
                                  headers={"content-type": content_type, "authorization": f"Bearer {KEYS['mallory']}"}))


def attack_adapter_regex_bomb(urls: dict) -> str:
    """A tenant's upload whose target_modules regex expands to 8e6 characters (29 characters sent)."""
    config, weights = _adapter_files({"target_modules": "(?:(?:(?:a{200}){200}){200})"})
    return _outcome(_upload(urls["gateway"], "bomb", config, weights, KEYS["mallory"]))


def attack_deep_json_schema(urls: dict) -> str:
    """A JSON schema of objects nested 400 deep (24 KiB; 8.8 s of xgrammar compile on the old code; deeper bodies stop
    at the JSON parser's recursion bound)."""
    depth = 400
    schema = '{"type":"object","properties":{"a":' * depth + '{"type":"string"}' + '},"required":["a"]}' * depth
    body = ('{"model": "base", "max_tokens": 16, "temperature": 0, "messages": ' + json.dumps(MESSAGES)
            + ', "structured_outputs": {"json": ' + schema + "}}")
    return _outcome(requests.post(f"{urls['gateway']}/v1/chat/completions", data=body, timeout=600,
                                  headers={"authorization": f"Bearer {KEYS['mallory']}",
                                           "content-type": "application/json"}))


def attack_ambiguous_grammar(urls: dict) -> str:
    """An EBNF grammar that compiles at once but whose matching grows with every token, n=4 samples."""
    return _outcome(_chat(urls["gateway"], KEYS["mallory"], n=4, max_tokens=256, temperature=1.0,
                          structured_outputs={"grammar": AMBIGUOUS_GRAMMAR}))


def attack_deep_sampling_parameters(urls: dict) -> str:
    """Triton's generate with sampling_parameters nested 250,000 deep (500 KB)."""
    body = {"text_input": "hi", "sampling_parameters": '{"stop": ' + "[" * 250_000 + "]" * 250_000 + "}",
            "api_key": KEYS["mallory"]}  # generate's other keys are request parameters
    r = requests.post(f"{urls['http']}/v2/models/lora_llm/generate", json=body, timeout=600)
    return f"{r.status_code} {r.text[:90]}"


def attack_megabyte_prompt(urls: dict) -> str:
    """A tenant's chat message just under the gateway's 2 MiB body bound."""
    messages = [{"role": "user", "content": "a " * (1000 * 1024 - 64)}]
    return _outcome(_chat(urls["gateway"], KEYS["mallory"], messages=messages, max_tokens=4))


ATTACKS = {name[len("attack_"):]: fn for name, fn in globals().items() if name.startswith("attack_")}


def neighbour(gateway: str, tokens: int) -> float:
    """Seconds for the good tenant's greedy chat of ``tokens`` tokens, streamed to the end."""
    t0 = time.perf_counter()
    with requests.post(f"{gateway}/v1/chat/completions", stream=True, timeout=600,
                       headers={"authorization": f"Bearer {KEYS['good']}"},
                       json={"model": "base", "messages": MESSAGES, "max_tokens": tokens, "temperature": 0,
                             "ignore_eos": True, "stream": True}) as r:
        r.raise_for_status()
        for _ in r.iter_lines():
            pass
    return time.perf_counter() - t0


def repeat_attack(attack, urls: dict, stop: threading.Event) -> tuple[int, float, str]:
    """Send ``attack`` again each time the last one ends, one at a time, until ``stop`` (at least once): how many
    were sent, the longest one's seconds, how the last ended."""
    count, longest, outcome = 0, 0.0, ""
    while count == 0 or not stop.is_set():
        t0 = time.perf_counter()
        try:
            outcome = attack(urls)
        except requests.RequestException as exc:
            outcome = type(exc).__name__
        count, longest = count + 1, max(longest, time.perf_counter() - t0)
    return count, longest, outcome


def poll_models(gateway: str, stop: threading.Event) -> float:
    """The slowest answer of another caller's GET /v1/models, polled every 0.1 s until ``stop``."""
    slowest = 0.0
    while not stop.is_set():
        t0 = time.perf_counter()
        requests.get(f"{gateway}/v1/models", headers={"authorization": f"Bearer {KEYS['good']}"}, timeout=600)
        slowest = max(slowest, time.perf_counter() - t0)
        stop.wait(0.1)
    return slowest


def start_server(work: Path, port: int) -> tuple[subprocess.Popen, dict]:
    tenants = {"tenants": {name: {"api_key_sha256": hashlib.sha256(key.encode()).hexdigest()}
                           for name, key in KEYS.items()}}
    (work / "tenants.json").write_text(json.dumps(tenants))
    urls = {"http": f"http://127.0.0.1:{port}", "gateway": f"http://127.0.0.1:{port + 3}"}
    args = [str(ROOT / ".venv" / "bin" / "loraplex-serve"), "--model", "smollm2", "--address", "127.0.0.1",
            "--http-port", str(port), "--grpc-port", str(port + 1), "--metrics-port", str(port + 2),
            "--openai-port", str(port + 3), "--served-model-name", "base", "--tenants-file", str(work / "tenants.json"),
            "--adapter-store", str(work / "store")]
    server = subprocess.Popen(args, stdout=open(work / "serve.log", "wb"), stderr=subprocess.STDOUT,
                              start_new_session=True, cwd=ROOT)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            if requests.get(f"{urls['gateway']}/health", timeout=2).ok and \
                    requests.get(f"{urls['http']}/v2/health/ready", timeout=2).ok:
                return server, urls
        except requests.RequestException:
            pass
        if server.poll() is not None:
            break
        time.sleep(1)
    raise SystemExit(f"loraplex-serve did not start; see {work / 'serve.log'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--attacks", default=",".join(ATTACKS), help=f"comma-separated, of: {', '.join(ATTACKS)}")
    parser.add_argument("--port", type=int, default=18300, help="Triton HTTP port; gRPC, metrics, gateway: +1..+3")
    parser.add_argument("--tokens", type=int, default=64, help="the neighbour's greedy tokens")
    parser.add_argument("--flood", action="store_true",
                        help="send each attack again as soon as it ends, for the whole of the neighbour's stream "
                             "(a flood, which a proxy's rate limit bounds), instead of once")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="loraplex-hostile-"))
    server, urls = start_server(work, args.port)
    try:
        for _ in range(2):
            neighbour(urls["gateway"], args.tokens)
        requests.get(f"{urls['gateway']}/v1/models", headers={"authorization": f"Bearer {KEYS['good']}"}, timeout=60)
        print(f"neighbour: {args.tokens} greedy tokens; each attack {'repeated back to back' if args.flood else 'sent once'}, "
              "0.3 s into the neighbour's stream", flush=True)
        print("| attack | neighbour alone, just before (s) | beside (s) | ratio | slowest /v1/models (s) | attacks sent | "
              "longest attack (s) | how the last ended |")
        print("|---|---|---|---|---|---|---|---|")
        for name in args.attacks.split(","):
            alone = neighbour(urls["gateway"], args.tokens)
            polling, flooding = threading.Event(), threading.Event()
            if not args.flood:
                flooding.set()  # one attack only
            with ThreadPoolExecutor(3) as pool:
                poller = pool.submit(poll_models, urls["gateway"], polling)
                beside = pool.submit(neighbour, urls["gateway"], args.tokens)
                time.sleep(0.3)
                attacks = pool.submit(repeat_attack, ATTACKS[name], urls, flooding)
                beside = beside.result()
                flooding.set()
                count, longest, outcome = attacks.result()
                polling.set()
                slowest = poller.result()
            print(f"| {name} | {alone:.2f} | {beside:.2f} | {beside / alone:.2f} | {slowest:.2f} | {count} | "
                  f"{longest:.1f} | {outcome.replace('|', '/')} |", flush=True)
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
    print(f"(server log: {work / 'serve.log'})", file=sys.stderr)


if __name__ == "__main__":
    main()
