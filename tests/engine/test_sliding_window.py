"""A checkpoint whose attention slides over a window is refused unless max_model_len fits in the window (our
attention is full: past the window it would be served wrong, with no error), and then served exactly as
transformers serves it (issue 40)."""

import pytest
from peft_reference import greedy_tokens
from transformers import MistralConfig, Qwen2Config

from loraplex.config import EngineConfig
from loraplex.engine.llm_engine import LLMEngine
from loraplex.engine.request import SamplingParams
from loraplex.models.builtin.demo import build_tiny_llama
from loraplex.models.loader import attention_window

WINDOW = 8


@pytest.fixture(scope="module")
def mistral_with_a_window(tmp_path_factory):
    return str(build_tiny_llama(tmp_path_factory.mktemp("swa") / "model", model_type="mistral",
                                sliding_window=WINDOW, max_position_embeddings=64))


def test_which_configs_slide():
    assert attention_window(MistralConfig(sliding_window=WINDOW)) == WINDOW
    assert attention_window(MistralConfig(sliding_window=None)) is None
    assert attention_window(Qwen2Config()) is None  # use_sliding_window false
    assert attention_window(Qwen2Config(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1,
                                        num_hidden_layers=3)) == WINDOW
    assert attention_window(Qwen2Config(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=3,
                                        num_hidden_layers=3)) is None  # every layer below max_window_layers: full


def test_a_window_shorter_than_max_model_len_is_refused_naming_the_fix(mistral_with_a_window):
    with pytest.raises(ValueError, match=f"sliding window of {WINDOW} tokens, which is not implemented; at "
                                         f"max_model_len 64 .* max_model_len <= {WINDOW}"):
        LLMEngine(EngineConfig(model_dir=mistral_with_a_window, device="cpu", dtype="float32"))


def test_within_its_window_the_checkpoint_is_served_exactly(mistral_with_a_window):
    engine = LLMEngine(EngineConfig(model_dir=mistral_with_a_window, device="cpu", dtype="float32",
                                    max_model_len=WINDOW, num_kv_blocks=16, block_size=4))
    request = engine.make_request("r", "Hi!", SamplingParams(max_tokens=4, temperature=0, ignore_eos=True), "t")
    engine.add_request(request)
    tokens = []
    while engine.has_work():
        for out in engine.step():
            assert out.error is None
            tokens += out.token_ids
    assert tokens == greedy_tokens(mistral_with_a_window, None, request.prompt_token_ids, 4, ignore_eos=True)
