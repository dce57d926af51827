"""A checkpoint config asking for what we do not implement is refused at load, never served wrong (issue 40)."""

import pytest
from transformers import LlamaConfig

from loraplex.models.loader import load_hf_config


def _saved(tmp_path, **kw):
    config = LlamaConfig(hidden_size=64, num_hidden_layers=1, num_attention_heads=4, intermediate_size=128,
                         vocab_size=300, architectures=["LlamaForCausalLM"], **kw)
    config.save_pretrained(tmp_path)
    return str(tmp_path)


def test_a_silu_llama_loads(tmp_path):
    assert load_hf_config(_saved(tmp_path)).hidden_act == "silu"


def test_another_activation_is_refused_naming_it(tmp_path):
    with pytest.raises(ValueError, match="hidden_act 'gelu' is not implemented"):
        load_hf_config(_saved(tmp_path, hidden_act="gelu"))
