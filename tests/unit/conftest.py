"""Fixtures of the LoRA unit tests: a tiny LLaMA config and its random model."""

import pytest
import torch
from tiny_llama import tiny_config
from transformers import LlamaForCausalLM


@pytest.fixture(scope="module")
def hf_config():
    return tiny_config()


@pytest.fixture(scope="module")
def base_model(hf_config):
    torch.manual_seed(0)
    return LlamaForCausalLM(hf_config).eval()
