"""Cost of what a tenant's adapter upload makes the server parse, compile and compute: the config's regexes,
adapter_config.json itself, the safetensors header and DoRA's norms, each at n and 2n in a child process under a
memory rlimit (tests/support/cost_harness.py). Decision 060."""

from __future__ import annotations

import json

from cost_harness import assert_linear

WHERE = "adapter 't'"


def _config(**fields) -> bytes:
    return json.dumps({"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": ["q_proj"], **fields}).encode()


def regex_nested_counts(n: int):
    """target_modules '(?:(?:(?:a{n}){n}){n})': before 060, regex.compile unrolled n**3 atoms (n=200: 2.3 GB)."""
    from loraplex.lora import adapter

    config = _config(target_modules="(?:(?:(?:a{%d}){%d}){%d})" % (n, n, n))
    return lambda: adapter._parse_config(config, WHERE)


def re_compile_nested_counts(n: int):
    """What peft accepts (re.compile) keeps counts as numbers: the same bomb costs it next to nothing."""
    import re

    pattern = "(?:(?:(?:a{%d}){%d}){%d})" % (n, n, n)
    return lambda: (re.purge(), re.compile(pattern))


def config_nested_json(n: int):
    """adapter_config.json of n KiB of '[': refused by its depth (RecursionError) or its size, never a crash."""
    from loraplex.lora import adapter

    config = b"[" * (n * 1024)
    return lambda: adapter._parse_config(config, WHERE)


def safetensors_many_tensors(n: int):
    """A safetensors header listing n*64 one-element tensors, each entry checked once."""
    from loraplex.lora.adapter import check_safetensors_header

    count = n * 64
    header = {f"t{i}": {"dtype": "F32", "shape": [1], "data_offsets": [4 * i, 4 * i + 4]} for i in range(count)}
    raw = json.dumps(header).encode()
    data = len(raw).to_bytes(8, "little") + raw + bytes(4 * count)
    return lambda: check_safetensors_header(data, max_tensors=count)


def dora_norms_by_rank(n: int):
    """DoRA's output scale of one 2048x2048 projection at rank n: linear in the rank (B @ A, then row norms)."""
    import torch

    from loraplex.lora.adapter import dora_output_scale

    torch.set_num_threads(1)
    torch.manual_seed(0)
    w, a, b = torch.randn(2048, 2048), torch.randn(n, 2048), torch.randn(2048, n)
    magnitude = torch.ones(2048)
    return lambda: dora_output_scale(w, a, b, 0.5, magnitude)


def test_regex_bombs_in_an_adapter_config_are_refused_before_compiling():
    small, large = assert_linear(regex_nested_counts, 200, max_seconds=0.1, mem_mb=1024)
    assert "expands past" in large.raised


def test_re_compile_of_the_same_bomb_is_cheap():
    assert_linear(re_compile_nested_counts, 200, max_seconds=0.05, mem_mb=512)


def test_a_deeply_nested_adapter_config_is_refused_linearly():
    small, large = assert_linear(config_nested_json, 40, max_seconds=0.1, mem_mb=1024)
    assert "nests too deeply" in small.raised and "at most 65536" in large.raised


def test_a_safetensors_header_of_many_tensors_is_checked_linearly():
    assert_linear(safetensors_many_tensors, 32, max_seconds=0.5, mem_mb=1024)


def test_dora_norms_grow_linearly_with_the_rank():
    assert_linear(dora_norms_by_rank, 32, max_seconds=1.0, mem_mb=1024)
