"""Loraplex against llama.cpp's `llama-server` on SmolLM2-135M-Instruct, in one run (issue 11, goal 7).

    python benchmarks/llamacpp.py [--streams 1,16] [--mixed-streams 16] [--max-tokens 64]
        [--llama-threads 1,2] [--repeats 2] [--json PATH]

What runs:
  ours       one `loraplex-serve --model smollm2` (benchmarks/serving.py's Launcher: free
             ports, a temp adapter store seeded with the demo adapters pirate and french),
             the fp32 checkpoint of .cache/smollm2/model, default engine knobs
             (`--engine-config` adds some; `--weights f16` adds weight_dtype float16); N concurrent HTTP `generate_stream` clients
             (benchmarks/triton_overhead.py's); tokens counted from the server's
             `num_output_tokens`.
  llama.cpp  one `llama-server` per `--llama-threads` value (`-t T -tb T --parallel P
             -c P*--ctx-per-seq`, P = the largest stream count; continuous batching is its
             default), on the same weights as an f32 GGUF (`--weights f16`: both hold the
             checkpoint's weights in fp16), the two adapters loaded as f32 LoRA
             GGUFs (`--lora`). N concurrent clients of its `/completion` (not streamed);
             tokens counted from its `tokens_predicted`. Every request sets both adapters'
             scales (`"lora": [{"id": 0, "scale": 1.0}, {"id": 1, "scale": 0.0}]`; the base
             model: both 0, and llama.cpp skips zero-scale adapters in its graph). It
             batches only requests with equal adapter scales: under mixed adapters each
             llama_decode carries one adapter's requests, the others wait for the next.

Both get the same prompt texts (SmolLM2's chat template around four questions, round-robin:
`loraplex.models.builtin.smollm2.chat_text`), greedy (temperature 0), exactly `--max-tokens` tokens each
(`ignore_eos`), their default prompt caching. Workloads: for each of `--streams`, N requests
of the base model at once; for each of `--mixed-streams`, N requests round-robin over
pirate and french. Output tokens/s = the tokens the servers report over the wall time from
the first request sent to the last answer. All servers start first and are warmed (one
request per adapter), a short greedy request per adapter is printed from both (do they
compute the same model?), then per workload the servers are alternated `--repeats` times
(ours, llama -t 1, llama -t 2, ours, ...), best of each. For one stream it also prints
llama-server's own decode-only rate (`timings.predicted_per_second`) and the memory
bandwidth it implies (the GGUF's bytes read once per token). The load average (the
machine may be shared) is printed before and after.

llama.cpp itself: the `llama-cpp-python` sdist (`--llama-cpp-python`, pinned) carries
llama.cpp's sources in `vendor/llama.cpp`. On first use the script downloads it with pip
into .cache/llamacpp/, builds `llama-server` there (`cmake -DGGML_NATIVE=ON
-DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF`, `--target llama-server -j<CPUs>`: 13 minutes on 2
cores), and converts the checkpoint (`convert_hf_to_gguf.py --outtype f32`) and the demo
adapters (`convert_lora_to_gguf.py --base`) with this Python and the vendored gguf-py.
Later runs reuse all of it. `--llama-server PATH` uses another binary.

On 2 cores llama.cpp gets `-t 1` under concurrent load: the client threads need the other
core and its spinning worker threads collapse when they do not get one.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from loraplex.launch.tritonserver import free_ports  # noqa: E402
from serving import BASE_MODEL, Launcher, model_and_adapters, server_environment, server_threads, warm_up  # noqa: E402
from triton_overhead import QUESTIONS, concurrently, parameters, prompts_for, through_triton  # noqa: E402

LLAMA_CPP_PYTHON = "0.3.36"  # its CHANGELOG: llama.cpp at ggml-org/llama.cpp@0c1e57098
CACHE = ROOT / ".cache" / "llamacpp"
ADAPTERS = ("pirate", "french")  # SmolLM2's demo adapters (demo_adapters/)


def log(msg: str) -> None:
    print(f"[llamacpp] {msg}", flush=True)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 2)[2],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", default="1,16", help="base-model workloads: concurrent request counts (default: %(default)s)")
    ap.add_argument("--mixed-streams", default="16",
                    help="mixed-adapter workloads (round-robin pirate/french): concurrent request counts; "
                         "empty: none (default: %(default)s)")
    ap.add_argument("--max-tokens", type=int, default=64, help="tokens per request, ignore_eos (default: %(default)s)")
    ap.add_argument("--repeats", type=int, default=2,
                    help="runs of each server per workload, alternated; the best is reported (default: %(default)s)")
    ap.add_argument("--llama-threads", default="1,2",
                    help="one llama-server per value: its -t/-tb (default: %(default)s)")
    ap.add_argument("--ctx-per-seq", type=int, default=256,
                    help="llama-server context per slot; -c is this times the slots (default: %(default)s)")
    ap.add_argument("--engine-config", default="{}", help="engine knobs (JSON) of our server (default: %(default)s)")
    ap.add_argument("--weights", choices=("f32", "f16"), default="f32",
                    help="f16: an f16 GGUF for llama.cpp and weight_dtype float16 for ours (default: %(default)s)")
    ap.add_argument("--llama-cpp-python", default=LLAMA_CPP_PYTHON,
                    help="version of the llama-cpp-python sdist whose vendored llama.cpp is built (default: %(default)s)")
    ap.add_argument("--llama-server", type=Path, help="an existing llama-server binary instead of the cached build")
    ap.add_argument("--cache", type=Path, default=CACHE, help="sdist, build and GGUFs (default: %(default)s)")
    ap.add_argument("--ready-timeout", type=float, default=300.0, help="seconds to wait for each server")
    ap.add_argument("--json", dest="json_path", type=Path, help="write the rows and settings here")
    return ap.parse_args(argv)


# -- llama.cpp: sources, build, GGUFs -------------------------------------------------------------

def llama_source(cache: Path, version: str) -> Path:
    """vendor/llama.cpp of the llama-cpp-python sdist, downloaded and unpacked once."""
    unpacked = cache / f"llama_cpp_python-{version}"
    src = unpacked / "vendor" / "llama.cpp"
    if (src / "CMakeLists.txt").is_file():
        return src
    cache.mkdir(parents=True, exist_ok=True)
    sdist = cache / f"llama_cpp_python-{version}.tar.gz"
    if not sdist.is_file():
        log(f"downloading the llama-cpp-python {version} sdist (~75 MB) into {cache}")
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                        f"llama-cpp-python=={version}", "-d", str(cache)], check=True)
    log(f"unpacking {sdist.name}")
    tmp = Path(tempfile.mkdtemp(dir=cache, prefix=".unpack-"))
    with tarfile.open(sdist) as tar:
        tar.extractall(tmp, filter="data")
    os.replace(tmp / unpacked.name, unpacked)
    shutil.rmtree(tmp, ignore_errors=True)
    return src


def upstream_commit(src: Path, version: str) -> str:
    """The llama.cpp commit the sdist's CHANGELOG names for ``version`` ('unknown' if none)."""
    text = (src.parents[1] / "CHANGELOG.md").read_text(errors="replace")
    section = text.split(f"## [{version}]", 1)[-1].split("\n## [", 1)[0]
    found = re.search(r"ggml-org/llama\.cpp@([0-9a-f]+)", section)
    return found.group(1) if found else "unknown"


def build_llama_server(src: Path, commit: str) -> Path:
    """build/bin/llama-server under ``src``, configured and built once."""
    binary = src / "build" / "bin" / "llama-server"
    if binary.is_file():
        return binary
    cmake = shutil.which("cmake")
    if cmake is None:
        raise SystemExit("llamacpp.py: cmake is not on PATH (e.g. `pip install --target /tmp/cmake cmake` "
                         "and put /tmp/cmake/bin on PATH)")
    jobs = str(os.cpu_count() or 2)
    log(f"building llama-server from {src} (llama.cpp {commit}; about 13 minutes on 2 cores)")
    start = time.monotonic()
    subprocess.run([cmake, "-B", "build", "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF",
                    "-DCMAKE_BUILD_TYPE=Release", f"-DLLAMA_BUILD_COMMIT={commit}"], cwd=src, check=True)
    subprocess.run([cmake, "--build", "build", "--target", "llama-server", "-j", jobs], cwd=src, check=True)
    log(f"llama-server built in {time.monotonic() - start:.0f} s")
    return binary


def converter_path(cache: Path) -> Path:
    """A folder holding sentencepiece for the converters, outside the project's virtualenv.

    convert_hf_to_gguf.py imports it even for a tokenizer.json-only checkpoint (before it
    looks for tokenizer.model); the serving environment does not need it.
    """
    pylib = cache / "pylib"
    if importlib.util.find_spec("sentencepiece") is None and not (pylib / "sentencepiece").is_dir():
        log(f"installing sentencepiece into {pylib} (for llama.cpp's converters only)")
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--target", str(pylib), "sentencepiece"],
                       check=True)
    return pylib


def convert(script: Path, args: list[str], out: Path, pylib: Path, outtype: str = "f32") -> Path:
    """Run one of llama.cpp's converters with this Python and the vendored gguf-py, into ``out`` once."""
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    path = [str(script.parent / "gguf-py"), str(pylib), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in path if p)}
    log_path = out.with_name(f"{out.name}.log")
    log(f"{script.name} -> {out} (log {log_path.name})")
    with open(log_path, "wb") as output:
        rc = subprocess.run([sys.executable, str(script), *args, "--outtype", outtype, "--outfile", str(tmp)], env=env,
                            stdout=output, stderr=subprocess.STDOUT, check=False).returncode
    if rc != 0:
        raise RuntimeError(f"{script.name} exited with code {rc}; log {log_path}:\n"
                           + log_path.read_text(errors="replace")[-3000:])
    os.replace(tmp, out)
    return out


def make_ggufs(src: Path, cache: Path, version: str, checkpoint: Path, adapters_dir: Path,
               weights: str = "f32") -> tuple[Path, list[Path]]:
    """(GGUF of the checkpoint in `weights`, f32 LoRA GGUFs of the demo adapters in ADAPTERS order)."""
    folder, pylib = cache / f"gguf-{version}", converter_path(cache)
    model = convert(src / "convert_hf_to_gguf.py", [str(checkpoint)], folder / f"smollm2-135m-instruct-{weights}.gguf",
                    pylib, weights)
    loras = [convert(src / "convert_lora_to_gguf.py", ["--base", str(checkpoint), str(adapters_dir / name)],
                     folder / f"lora-{name}-f32.gguf", pylib) for name in ADAPTERS]
    return model, loras


class LlamaServer(Launcher):
    """One `llama-server` in its own process group on a free port; starts and stops like our Launcher."""

    NAME, READY_PATH = "llama-server", "/health"  # /health answers 200 once the model is loaded

    def __init__(self, binary: Path, model: Path, loras: list[Path], threads: int, slots: int, ctx_per_seq: int,
                 log_path: Path):
        (self.http_port,) = free_ports(1)
        self.threads = threads
        self.command = [str(binary), "-m", str(model), "--host", "127.0.0.1", "--port", str(self.http_port),
                        "-t", str(threads), "-tb", str(threads), "--parallel", str(slots),
                        "-c", str(slots * ctx_per_seq), "--no-webui"]
        for lora in loras:
            self.command += ["--lora", str(lora)]
        self.log_path = log_path
        self.env = server_environment()
        self.proc = None


# -- clients ---------------------------------------------------------------------------------------

def llama_body(prompt: str, max_tokens: int, adapter: str) -> dict:
    """A greedy /completion request of exactly ``max_tokens`` tokens, on ``adapter`` (its --lora index).

    Every request names its adapters' scales, the base model too (all 0). Without a `lora`
    field a slot takes the global list, whose scales stay 1.0 even under
    --lora-init-without-apply (that only skips applying them at start-up), and it keeps its
    cached prompt from a request under other adapters: both seen in this version.
    """
    scales = [{"id": i, "scale": 1.0 if name == adapter else 0.0} for i, name in enumerate(ADAPTERS)]
    return {"prompt": prompt, "n_predict": max_tokens, "temperature": 0, "ignore_eos": True, "stream": False,
            "lora": scales}


def post_json(url: str, body: dict, timeout: float = 600) -> dict:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read())


def llama_one(url: str, prompt: str, max_tokens: int, adapter: str, tokens: list, rates: list, index: int) -> None:
    answer = post_json(f"{url}/completion", llama_body(prompt, max_tokens, adapter))
    tokens[index] = int(answer["tokens_predicted"])
    rates[index] = float(answer["timings"]["predicted_per_second"])


def through_llama(url: str, prompts: list[str], adapters: list[str], max_tokens: int,
                  decode_rates: list | None = None) -> float:
    """tok/s of len(prompts) concurrent /completion requests (tokens as llama-server reports them).

    ``decode_rates`` gets each request's decode-only tokens/s from llama-server's own timings.
    """
    tokens, rates = [0] * len(prompts), [0.0] * len(prompts)
    elapsed = concurrently(llama_one, [(url, p, max_tokens, adapters[i % len(adapters)], tokens, rates, i)
                                       for i, p in enumerate(prompts)])
    if sum(tokens) != max_tokens * len(prompts):
        raise RuntimeError(f"llama-server generated {sum(tokens)} tokens, expected {max_tokens * len(prompts)}")
    if decode_rates is not None:
        decode_rates[:] = rates
    return sum(tokens) / elapsed


def ours_text(url: str, prompt: str, max_tokens: int, adapter: str) -> str:
    body = {"text_input": prompt, "exclude_input_in_output": True, "parameters": parameters(max_tokens, adapter)}
    return post_json(f"{url}/v2/models/lora_llm/generate", body)["text_output"]


def llama_text(url: str, prompt: str, max_tokens: int, adapter: str) -> str:
    return post_json(f"{url}/completion", llama_body(prompt, max_tokens, adapter))["content"]


def compare_outputs(ours_url: str, llama_url: str, max_tokens: int = 24) -> list[dict]:
    """One greedy answer per adapter from both servers: the same weights should give (nearly) the same text."""
    from loraplex.models.builtin.smollm2 import chat_text

    prompt, rows = chat_text(QUESTIONS[3]), []
    for adapter in (BASE_MODEL, *ADAPTERS):
        a, b = ours_text(ours_url, prompt, max_tokens, adapter), llama_text(llama_url, prompt, max_tokens, adapter)
        common = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        rows.append({"adapter": adapter, "ours": a, "llama": b, "same": a == b, "common_prefix_chars": common})
        log(f"{adapter:>7}: ours  {a!r}")
        log(f"{'':>7}  llama {b!r}  ({'same text' if a == b else f'first {common} chars agree'})")
    return rows


def load_average() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def main(argv=None) -> int:
    args = parse_args(argv)
    base_streams = [int(s) for s in args.streams.split(",") if s]
    mixed_streams = [int(s) for s in args.mixed_streams.split(",") if s]
    thread_counts = [int(t) for t in args.llama_threads.split(",")]
    workloads = [("base", n, [BASE_MODEL]) for n in base_streams] + [("mixed", n, list(ADAPTERS)) for n in mixed_streams]
    slots = max(n for _, n, _ in workloads)
    load_before = load_average()
    log(f"load average before: {load_before} ({os.cpu_count()} CPUs)")

    model_flags, checkpoint, _ = model_and_adapters(argparse.Namespace(model_dir=None, model="smollm2",
                                                                       adapters=",".join(ADAPTERS)))
    from loraplex.launch.serve import builtin_model

    adapters_dir = builtin_model("smollm2")[1]
    src = llama_source(args.cache, args.llama_cpp_python)
    commit = upstream_commit(src, args.llama_cpp_python)
    binary = args.llama_server or build_llama_server(src, commit)
    gguf, loras = make_ggufs(src, args.cache, args.llama_cpp_python, checkpoint, adapters_dir, args.weights)
    version = subprocess.run([str(binary), "--version"], capture_output=True, text=True,
                             check=False).stderr.strip().splitlines()
    log(f"llama.cpp: llama-cpp-python {args.llama_cpp_python} sdist, upstream {commit}; {' / '.join(version)}")

    work = Path(tempfile.mkdtemp(prefix="llamacpp-bench-"))
    engine_config = json.loads(args.engine_config)
    if args.weights == "f16":
        engine_config.setdefault("weight_dtype", "float16")
    ours = Launcher(model_flags, engine_config, work / "store", work / "loraplex-serve.log")
    llamas = [LlamaServer(binary, gguf, loras, t, slots, args.ctx_per_seq, work / f"llama-server-t{t}.log")
              for t in thread_counts]
    torch_threads, native_threads = server_threads(engine_config)
    log(f"logs in {work}; ours: {torch_threads} torch, {native_threads} native threads; "
        f"llama-server: {' '.join(llamas[0].command[1:])}")
    rows = []
    try:
        ours.start(args.ready_timeout)
        for llama in llamas:
            llama.start(args.ready_timeout)
        log("servers ready; warming up")
        warm_up(ours.http_url, [BASE_MODEL, *ADAPTERS])
        for llama in llamas:
            for adapter in (BASE_MODEL, *ADAPTERS):
                through_llama(llama.http_url, prompts_for("smollm2", 1), [adapter], 4)
        outputs = compare_outputs(ours.http_url, llamas[0].http_url)
        for name, n, adapters in workloads:
            prompts = prompts_for("smollm2", n)
            best = {"ours": 0.0, **{t: 0.0 for t in thread_counts}}
            decode = {t: 0.0 for t in thread_counts}  # llama's decode-only tok/s per request, median, of its best run
            for _ in range(args.repeats):
                best["ours"] = max(best["ours"], through_triton(ours.http_url, prompts, adapters, args.max_tokens))
                for llama in llamas:
                    rates: list[float] = []
                    tok_s = through_llama(llama.http_url, prompts, adapters, args.max_tokens, rates)
                    if tok_s > best[llama.threads]:
                        best[llama.threads], decode[llama.threads] = tok_s, statistics.median(rates)
            row = {"workload": name, "streams": n, "ours_tok_s": best["ours"],
                   "llama_tok_s": {str(t): best[t] for t in thread_counts},
                   "llama_decode_tok_s_per_request": {str(t): decode[t] for t in thread_counts}}
            rows.append(row)
            log(f"{name} x{n}: ours {best['ours']:.1f} tok/s; "
                + "; ".join(f"llama.cpp -t {t} {best[t]:.1f} tok/s (ratio {best['ours'] / best[t]:.2f})"
                            for t in thread_counts))
    finally:
        for server in (ours, *llamas):
            server.stop()
    load_after = load_average()

    print(f"\nSmolLM2-135M-Instruct, {args.weights} weights, {args.max_tokens} greedy tokens per request (ignore_eos), "
          f"best of {args.repeats}; ratio = ours / llama.cpp")
    header = f"{'workload':<9}{'streams':>8}{'ours tok/s':>12}" + "".join(
        f"{f'llama -t {t} tok/s':>19}{'ratio':>7}" for t in thread_counts)
    print(header)
    for row in rows:
        line = f"{row['workload']:<9}{row['streams']:>8}{row['ours_tok_s']:>12.1f}"
        for t in thread_counts:
            theirs = row["llama_tok_s"][str(t)]
            line += f"{theirs:>19.1f}{row['ours_tok_s'] / theirs:>6.2f}x"
        print(line)
    weights = gguf.stat().st_size
    for row in rows:
        if row["streams"] == 1:
            print(f"llama.cpp decode only (its timings), {row['workload']} x1: " + ", ".join(
                f"-t {t} {rate:.1f} tok/s = {rate * weights / 1e9:.1f} GB/s of {args.weights} weights ({weights / 1e6:.0f} MB a token)"
                for t, rate in row["llama_decode_tok_s_per_request"].items()))
    print(f"load average (1, 5, 15 min): before {load_before}, after {load_after}; {os.cpu_count()} CPUs")
    print(f"llama.cpp {commit} (llama-cpp-python {args.llama_cpp_python} sdist)")
    if args.json_path:
        args.json_path.write_text(json.dumps({
            "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
            "llama_cpp_python": args.llama_cpp_python, "llama_cpp_commit": commit, "llama_server_version": version,
            "llama_server_command": llamas[0].command, "load_before": load_before, "load_after": load_after,
            "gguf_bytes": weights, "outputs": outputs, "rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
