"""Which decode graphs are captured and which one a step replays (no GPU: the shim test runs the replays)."""

import logging

import torch

from loraplex.decode_graphs import DecodeGraphs, build_decode_graphs, capture_sizes


def test_capture_sizes_reach_max_num_seqs():
    assert capture_sizes(256)[:5] == [1, 2, 4, 8, 16] and capture_sizes(256)[-1] == 256
    assert capture_sizes(100)[-2:] == [96, 100]  # a full batch never runs eagerly
    assert capture_sizes(1) == [1]


def test_a_step_replays_the_smallest_graph_that_holds_it():
    """Without LoRA stacks only the graphs without adapters are captured."""
    class Model:  # the forward's inputs are all the capture sees here
        device = "cpu"

        def forward(self, input_ids, attn, kv_cache, lora):
            return torch.zeros(len(input_ids), 4)

    graphs = DecodeGraphs(Model(), None, [1, 2, 4, 8], max_blocks_per_seq=4,
                          capture=lambda forward: (lambda: None, forward()))
    assert [graphs.size_for(n) for n in (1, 2, 3, 5, 8, 9)] == [1, 2, 4, 8, 8, None]
    assert {key: len(output) for key, (_, output) in graphs.graphs.items()} == {(1, False): 1, (2, False): 2,
                                                                                 (4, False): 4, (8, False): 8}


def test_a_failed_capture_leaves_decode_eager(caplog):
    class Model:
        device = "cpu"

        def forward(self, *args):
            raise RuntimeError("no graphs here")

    with caplog.at_level(logging.WARNING, logger="loraplex.graphs"):
        assert build_decode_graphs(Model(), None, max_num_seqs=4, max_model_len=64, block_size=16) is None
    assert "decode steps run eagerly" in caplog.text
