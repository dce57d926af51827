"""A LlamaConfig small enough to build in milliseconds (LoRA unit tests)."""

from transformers import LlamaConfig


def tiny_config(**kw):
    """Tiny LLaMA config; keyword arguments override."""
    args = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                intermediate_size=128, vocab_size=300)
    return LlamaConfig(**{**args, **kw})


def build_model_and_adapters(root, model: dict, adapters: dict) -> tuple[str, dict[str, str]]:
    """A tiny random LLaMA (build_tiny_llama's keywords in model) and PEFT adapters {name: {r, alpha,
    target_modules, seed}} under root: (model dir, name -> adapter dir)."""
    from loraplex.models.builtin.demo import build_peft_adapter, build_tiny_llama

    model_dir = build_tiny_llama(root / "model", **model)
    return str(model_dir), {
        name: str(build_peft_adapter(model_dir, root / name, s["r"], s["alpha"], s["target_modules"], s["seed"],
                                     b_scale=0.3))
        for name, s in adapters.items()}


def run_greedy(engine, requests, max_tokens) -> tuple[dict, dict]:
    """Add (request id, lora name or None, prompt, n) greedy requests to engine and step it until idle:
    (request id -> Request, (request id, sample index) -> token ids); max_tokens: an int, or a dict by
    request id. An output with an error fails the test."""
    from collections import defaultdict

    from loraplex.engine.request import SamplingParams

    made = {}
    for rid, lora, prompt, n in requests:
        limit = max_tokens[rid] if isinstance(max_tokens, dict) else max_tokens
        params = SamplingParams.from_dict({"temperature": 0, "max_tokens": limit, "n": n}
                                          | ({"lora_name": lora} if lora else {}))
        made[rid] = engine.make_request(rid, prompt, params, "t")
        engine.add_request(made[rid])
    tokens = defaultdict(list)
    while engine.has_work():
        for out in engine.step():
            assert out.error is None, out.error
            tokens[out.request_id, out.index] += out.token_ids
    return made, tokens
