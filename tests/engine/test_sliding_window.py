"""Sliding windows are read per layer as transformers reads them, and a windowed checkpoint is served exactly as
transformers serves it past its window (issue 40: Mistral's window was once silently ignored)."""

import pytest
from exactness import ENGINE_DEVICE
from peft_reference import greedy_tokens
from transformers import Gemma2Config, MistralConfig, Qwen2Config

from loraplex.config import EngineConfig
from loraplex.engine.llm_engine import LLMEngine
from loraplex.engine.request import SamplingParams
from loraplex.models.builtin.demo import build_tiny_llama
from loraplex.models.family import layer_windows

WINDOW = 8


@pytest.fixture(scope="module")
def mistral_with_a_window(tmp_path_factory):
    return str(build_tiny_llama(tmp_path_factory.mktemp("swa") / "model", model_type="mistral",
                                sliding_window=WINDOW, max_position_embeddings=64))


def test_which_layers_slide():
    assert layer_windows(MistralConfig(sliding_window=WINDOW, num_hidden_layers=2)) == (WINDOW, WINDOW)
    assert layer_windows(MistralConfig(sliding_window=None, num_hidden_layers=2)) == (None, None)
    assert layer_windows(Qwen2Config(num_hidden_layers=2)) == (None, None)  # use_sliding_window false
    # Qwen2: the layers from max_window_layers on slide
    assert layer_windows(Qwen2Config(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1,
                                     num_hidden_layers=3)) == (None, WINDOW, WINDOW)
    assert layer_windows(Gemma2Config(sliding_window=WINDOW, num_hidden_layers=4)) == (WINDOW, None, WINDOW, None)


def test_past_its_window_the_checkpoint_is_served_exactly(mistral_with_a_window):
    engine = LLMEngine(EngineConfig(model_dir=mistral_with_a_window, device=ENGINE_DEVICE, dtype="float32",
                                    max_model_len=64, num_kv_blocks=32, block_size=4))
    request = engine.make_request("r", "Hi! " * WINDOW, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True),
                                  "t")
    assert len(request.prompt_token_ids) > 3 * WINDOW
    engine.add_request(request)
    tokens = []
    while engine.has_work():
        for out in engine.step():
            assert out.error is None
            tokens += out.token_ids
    assert tokens == greedy_tokens(mistral_with_a_window, None, request.prompt_token_ids, 12, ignore_eos=True)
