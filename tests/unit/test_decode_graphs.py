"""Which decode graphs are captured and which one a step replays (no GPU: the shim test runs the replays)."""

import logging

import pytest
import torch

from loraplex.worker.decode_graphs import DecodeGraphs, build_decode_graphs, capture_sizes


def test_capture_sizes_reach_max_num_seqs():
    assert capture_sizes(256)[:5] == [1, 2, 4, 8, 16] and capture_sizes(256)[-1] == 256
    assert capture_sizes(100)[-2:] == [96, 100]  # a full batch never runs eagerly
    assert capture_sizes(1) == [1]


class Model:
    """What the capture sees of a model: its device, sizes and forward (here a function of the ids and
    positions only)."""

    device, vocab_size, max_len = "cpu", 100, 64

    def forward(self, input_ids, attn, kv_cache, lora):
        return torch.stack([input_ids, attn.positions], dim=1).float()


KV_CACHE = torch.zeros(1, 2, 2, 4, 1, 8)  # [layers, K/V, blocks, block size, heads, head dim]: 8 slots


def rerun(forward):
    """A stand-in for CUDA graph capture: the replay reruns the forward into the static output."""
    output = forward().clone()
    return (lambda: output.copy_(forward())), output


def test_a_step_replays_the_smallest_graph_that_holds_it():
    """Without LoRA stacks only the graphs without adapters are captured."""
    graphs = DecodeGraphs(Model(), KV_CACHE, [1, 2, 4, 8], max_blocks_per_seq=4, capture=rerun)
    assert [graphs.size_for(n) for n in (1, 2, 3, 5, 8, 9)] == [1, 2, 4, 8, 8, None]
    assert {key: len(output) for key, (_, output) in graphs.graphs.items()} == {(1, False): 1, (2, False): 2,
                                                                                 (4, False): 4, (8, False): 8}


def test_a_replay_that_differs_from_the_eager_forward_is_refused():
    """A capture whose replay keeps its capture-time output (a kernel that ran instead of joining the graph)."""
    def frozen(forward):
        output = forward().clone()
        return (lambda: None), output

    with pytest.raises(RuntimeError, match="differs from the eager forward"):
        DecodeGraphs(Model(), KV_CACHE, [1, 2, 4], max_blocks_per_seq=4, capture=frozen)
    graphs = DecodeGraphs(Model(), KV_CACHE, [1, 2, 4], max_blocks_per_seq=4, capture=rerun)
    assert int(graphs.input_ids.abs().sum()) == 0 and int(graphs.positions.abs().sum()) == 0  # reset after


def test_a_failed_capture_leaves_decode_eager(caplog):
    class Broken(Model):
        def forward(self, *args):
            raise RuntimeError("no graphs here")

    with caplog.at_level(logging.WARNING, logger="loraplex.graphs"):
        assert build_decode_graphs(Broken(), KV_CACHE, max_num_seqs=4, max_model_len=64, block_size=16) is None
    assert "decode steps run eagerly" in caplog.text


def test_a_value_memoized_before_the_capture_is_caught_and_no_memo_is_reused_in_one(monkeypatch):
    """The first GPU run's bug: the RoPE rows of the static positions buffer, memoized by the tensor's identity
    in the eager warm-up, were replayed as constants. The replay check catches such a model; with PerStepMemo
    computing afresh during capture (CUDA only; here the capture is said to run) it passes."""
    from loraplex.kernels import reference

    class Memoizing(Model):
        memo = reference.PerStepMemo()

        def forward(self, input_ids, attn, kv_cache, lora):
            rows = self.memo.get(attn.positions, (), lambda: attn.positions.clone())
            return torch.stack([input_ids, rows], dim=1).float()

    with torch.inference_mode():  # as the engine builds them: inference tensors keep no version to spot a write
        with pytest.raises(RuntimeError, match="differs from the eager forward"):
            DecodeGraphs(Memoizing(), KV_CACHE, [4], max_blocks_per_seq=4, capture=rerun)  # the memo keeps size 4's
        monkeypatch.setattr(reference, "_capturing", lambda tensor: True)
        DecodeGraphs(Memoizing(), KV_CACHE, [4], max_blocks_per_seq=4, capture=rerun)
