"""A LlamaConfig small enough to build in milliseconds (LoRA unit tests)."""

from transformers import LlamaConfig


def tiny_config(**kw):
    """Tiny LLaMA config; keyword arguments override."""
    args = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                intermediate_size=128, vocab_size=300)
    return LlamaConfig(**{**args, **kw})
