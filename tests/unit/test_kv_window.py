"""KV manager with a sliding window (decision 065): which configs slide, exact tables as the window moves, the
null block, the pool's accounting, prefix hits past freed holes, forks, and swap-out/resume of the live blocks."""

import pytest
from transformers import (
    Gemma2Config, Gemma3TextConfig, LlamaConfig, MistralConfig, MixtralConfig, Phi3Config, Qwen2Config, Qwen3Config,
    Qwen3MoeConfig,
)

from loraplex.kv_cache import KVCacheManager, namespace_key
from loraplex.kv_cache.window import common_window, kv_window
from loraplex.models.family import layer_windows

NS = namespace_key("tenant-a", None)
BS = 4
W = 6  # a query at p reads keys p-5..p: a block leaves once all of it is <= computed - 6


def prefill(kv, seq, tokens, chunk=None):
    """Admit tokens (prefix hit, then chunks of `chunk`), freeing behind the window before each chunk as the
    scheduler does; returns (blocks found, tokens covered)."""
    blocks, covered = kv.find_cached_prefix(tokens, NS)
    done, first = covered, True
    while done < len(tokens):
        n = min(chunk or len(tokens), len(tokens) - done)
        kv.free_skipped(seq, done)
        assert kv.allocate(seq, done, n, blocks if first else ())
        first = False
        done += n
        kv.cache_full_blocks(seq, tokens, done, NS)
        kv.check_invariants()
    return blocks, covered


def decode(kv, seq, tokens, steps):
    """`steps` decode steps: free behind the window, allocate one slot, 'compute' it."""
    for _ in range(steps):
        kv.free_skipped(seq, len(tokens))
        assert kv.allocate(seq, len(tokens), 1)
        tokens.append(100 + len(tokens))
        kv.cache_full_blocks(seq, tokens, len(tokens), NS)
        kv.check_invariants()


# ----------------------------------------------------------------- which checkpoints free blocks


@pytest.mark.parametrize("config, window", [
    (MistralConfig(sliding_window=W), W),
    (MistralConfig(sliding_window=None), None),
    (MixtralConfig(sliding_window=W), W),
    (Phi3Config(sliding_window=W), W),
    (Phi3Config(), None),
    (LlamaConfig(), None),
    (Qwen2Config(sliding_window=W), None),  # use_sliding_window false
    (Qwen2Config(use_sliding_window=True, sliding_window=W, max_window_layers=0, num_hidden_layers=3), W),
    # HF slides layers i >= max_window_layers: layer 0 attends fully and needs every block
    (Qwen2Config(use_sliding_window=True, sliding_window=W, max_window_layers=1, num_hidden_layers=3), None),
    (Qwen3Config(use_sliding_window=True, sliding_window=W, max_window_layers=0, num_hidden_layers=2), W),
    (Qwen3Config(use_sliding_window=True, sliding_window=W, max_window_layers=2, num_hidden_layers=2), None),
    (Qwen3MoeConfig(use_sliding_window=True, sliding_window=W), W),
    (Qwen3MoeConfig(sliding_window=W), None),
    (Gemma2Config(sliding_window=W, num_hidden_layers=4), None),  # interleaved: global layers
    (Gemma3TextConfig(sliding_window=W, num_hidden_layers=6), None),
    (Gemma3TextConfig(sliding_window=W, num_hidden_layers=2, layer_types=["sliding_attention"] * 2), W),
])
def test_a_window_counts_only_when_every_layer_slides_over_it(config, window):
    assert kv_window(config) == window
    assert common_window(layer_windows(config)) == window  # what the engine asks of the model's attention


def test_common_window():
    assert common_window((W, W, W)) == W
    assert common_window((W, None)) is None and common_window((W, 2 * W)) is None
    assert common_window((None, None)) is None and common_window(()) is None


# ----------------------------------------------------------------- freeing as the window moves


def test_blocks_behind_the_window_go_back_and_the_table_keeps_null_entries():
    kv = KVCacheManager(8, BS, window=W)
    assert kv.null_block == 0 and kv.num_usable_blocks == 7
    assert kv.usage() == {"used": 0, "cached": 0, "free": 7}
    tokens = list(range(10, 19))  # 9 tokens: blocks 1, 2, 3
    prefill(kv, "a", tokens)
    assert kv.block_table("a") == [1, 2, 3]
    # the next query is at 9: it reads keys 4..9, so block 1 (positions 0-3) is never read again
    assert kv.skipped_blocks(9) == 1 and kv.skipped_blocks(8) == 0
    assert kv.free_skipped("a", 9)
    assert kv.block_table("a") == [0, 2, 3]
    assert not kv.free_skipped("a", 9) and not kv.free_skipped("a", 12)  # nothing more until position 13
    assert kv.pool.free_queue.ids()[-1] == 1 and kv.usage() == {"used": 2, "cached": 1, "free": 5}
    decode(kv, "a", tokens, 8)  # to 17 tokens: the last query, at 16, read keys 11..16
    assert kv.block_table("a") == [0, 0, 3, 4, 5] and kv.num_freed_by_window == 2
    kv.free("a")
    kv.check_invariants()
    assert kv.usage() == {"used": 0, "cached": 4, "free": 7}  # the null block stays held, outside the counts


def test_a_long_sequence_holds_a_bounded_number_of_blocks():
    kv = KVCacheManager(6, BS, window=W)  # 5 usable blocks: 20 tokens at most without the window
    tokens = list(range(7))
    prefill(kv, "a", tokens)
    peak = 0
    for _ in range(200):
        decode(kv, "a", tokens, 1)
        peak = max(peak, kv.usage()["used"])
        assert kv.usage()["used"] + kv.num_free_blocks == kv.num_usable_blocks
    assert len(tokens) == 207 and peak == 3 == kv.max_blocks_held(207, 1)
    assert len(kv.block_table("a")) == 52 and kv.block_table("a")[:49] == [0] * 49


def test_max_blocks_held_is_the_window_and_a_chunk_at_worst_one_slot_into_a_block():
    full = KVCacheManager(64, BS)
    kv = KVCacheManager(64, BS, window=W)
    assert full.max_blocks_held(100, 16) == 25 and kv.max_blocks_held(100, 16) == 6  # ceil((6 + 16 + 4 - 2) / 4)
    assert kv.max_blocks_held(100, 1) == 3 and kv.max_blocks_held(100, 200) == 25  # a chunk as long as the seq
    assert kv.max_blocks_held(5, 16) == 2  # never more than the whole sequence
    # reached: the keys 8..12 a chunk at 13 reads start one slot before block 2 ends
    tokens = list(range(40))
    prefill(kv, "a", tokens[:13])
    kv.free_skipped("a", 13)
    assert kv.allocate("a", 13, 16) and len(kv.block_table("a")) - kv._skipped["a"] == 6


def test_chunked_prefill_frees_only_what_the_next_chunk_cannot_read():
    kv = KVCacheManager(16, BS, window=W)
    tokens = list(range(24))
    prefill(kv, "a", tokens, chunk=5)  # chunks start at 0, 5, 10, 15, 20
    # the chunk at 20 reads from key 15 (block 3) on: blocks 0-2 were freed, 3-5 held
    assert kv.block_table("a") == [0, 0, 0, 4, 5, 6]


# ----------------------------------------------------------------- prefix hits across holes


def test_a_prefix_hit_starts_past_the_hole_and_holds_only_the_window_before_it():
    kv = KVCacheManager(16, BS, window=W)
    prompt = list(range(100, 124))  # 24 tokens, 6 blocks
    prefill(kv, "a", prompt, chunk=8)
    table_a = list(kv.block_table("a"))
    kv.free("a")
    blocks, covered = kv.find_cached_prefix(prompt + [7, 8], NS)
    # a first query at 24 reads keys 19..24: blocks 4 and 5 hold 19..23; blocks 0-3 need not be there at all
    assert covered == 24 and blocks == [0, 0, 0, 0, table_a[4], table_a[5]]
    assert kv.num_hits_past_a_hole == 1
    assert kv.allocate("b", 24, 2, blocks)
    assert kv.block_table("b")[:6] == blocks and kv._skipped["b"] == 4
    longer = prompt + [7, 8, 9, 10]
    kv.cache_full_blocks("b", longer, 26, NS)
    assert kv.allocate("b", 26, 2)
    kv.cache_full_blocks("b", longer, 28, NS)  # the hash chain runs through the hole: b's new block is a hit
    assert kv.find_cached_prefix(longer + [11], NS) == ([0, 0, 0, 0, 0, table_a[5], kv.block_table("b")[6]], 28)
    kv.check_invariants()


def test_blocks_freed_from_a_running_sequences_window_stay_prefix_hits():
    kv = KVCacheManager(16, BS, window=W)
    prompt = list(range(100, 116))  # 16 tokens
    prefill(kv, "a", prompt)
    tokens = list(prompt)
    decode(kv, "a", tokens, 9)  # a's window has moved past blocks 1-4 (a's first three)
    assert kv.block_table("a")[:3] == [0, 0, 0]
    blocks, covered = kv.find_cached_prefix(prompt[:12] + [1, 2, 3, 4, 5], NS)
    assert covered == 12 and blocks == [0, 2, 3]  # a's freed (cached) blocks 2 and 3 hold keys 7..11
    assert kv.allocate("b", 12, 5, blocks)
    assert kv.pool.blocks[2].ref_count == kv.pool.blocks[3].ref_count == 1
    kv.check_invariants()


def test_a_short_run_of_hits_counts_only_from_the_start():
    kv = KVCacheManager(16, BS, window=9)  # a hit must hold the 8 keys before it: two blocks
    prompt = list(range(100, 116))
    prefill(kv, "a", prompt)
    kv.free("a")
    other = [1, 2, 3, 4] + prompt[4:] + [9]  # block 0 differs, so every later hash differs: a miss
    assert kv.find_cached_prefix(other, NS) == ([], 0)
    assert kv.find_cached_prefix(prompt[:6], NS) == ([1], 4)  # a run from the start, shorter than two blocks


def test_an_evicted_block_inside_the_needed_run_moves_the_hit_back():
    kv = KVCacheManager(8, BS, window=W)
    prompt = list(range(100, 124))
    prefill(kv, "a", prompt[:20])
    kv.free("a")
    assert kv.find_cached_prefix(prompt[:21], NS) == ([0, 0, 0, 4, 5], 20)
    taken = kv.pool.take_new(3)  # the free queue is 6, 7, then a's tail first: evicts block 5 (positions 16..19)
    assert taken == [6, 7, 5]
    assert kv.find_cached_prefix(prompt[:21], NS) == ([0, 0, 3, 4], 16)
    kv.pool.release(taken)
    kv.check_invariants()


def test_a_hit_needs_every_block_of_its_window_cached():
    kv = KVCacheManager(8, BS, window=W)
    prompt = list(range(100, 121))
    prefill(kv, "a", prompt[:20])  # blocks 1-5
    kv.free("a")
    kv.pool.touch([5])  # held by someone while three blocks are taken: 6, 7, then block 4 (positions 12..15)
    taken = kv.pool.take_new(3)
    kv.pool.release([5])
    assert taken == [6, 7, 4] and kv.pool.blocks[5].block_hash is not None
    # block 5 alone holds only 4 of the 5 keys a query at 20 reads: the hit ends at 12, after blocks 2 and 3
    assert kv.find_cached_prefix(prompt, NS) == ([0, 2, 3], 12)
    kv.pool.release(taken)
    kv.check_invariants()


# ----------------------------------------------------------------- forks and preemption


def test_a_fork_shares_the_live_blocks_and_the_holes():
    kv = KVCacheManager(16, BS, window=W)
    tokens = list(range(13))
    prefill(kv, "a", tokens)
    kv.free_skipped("a", 13)
    kv.fork("a", "b")
    assert kv.block_table("b") == kv.block_table("a") == [0, 0, 3, 4]
    assert [kv.pool.blocks[b].ref_count for b in (3, 4)] == [2, 2]
    child = list(tokens)
    decode(kv, "a", tokens, 4)
    decode(kv, "b", child, 4)
    assert kv.block_table("a") == [0, 0, 3, 5, 6] and kv.block_table("b") == [0, 0, 3, 4, 7]
    assert kv.take_copy_pairs() == [(4, 5)]  # a wrote first into the shared block: copied first
    decode(kv, "a", tokens, 1)  # the window leaves the shared block 3: a drops its reference, b still reads it
    assert kv.block_table("a")[:3] == [0, 0, 0] and kv.pool.blocks[3].ref_count == 1
    decode(kv, "b", child, 1)
    assert kv.pool.blocks[3].ref_count == 0 and kv.pool.free_queue.ids()[-1] == 3
    kv.free("a")
    kv.free("b")
    kv.check_invariants()
    assert kv.usage()["used"] == 0


def test_swap_out_reads_the_live_blocks_and_resume_restores_them_behind_null_entries():
    kv = KVCacheManager(16, BS, window=W)
    tokens = list(range(18))
    prefill(kv, "a", tokens)
    kv.free_skipped("a", 15)  # freed at the step's start; the step then computed up to 18
    assert kv.block_table("a") == [0, 0, 3, 4, 5]
    # the next query is at 18: keys 13..17, blocks 3 and 4; block 2 (8..11) is not read any more
    assert kv.source_blocks("a", 18) == [4, 5]
    kv.free("a")
    assert kv.blocks_to_resume(18, 1) == 2
    fresh = kv.resume("a", 18)  # the swap-in destinations of those two blocks
    assert fresh == [6, 7] and kv.block_table("a") == [0, 0, 0, 6, 7]
    kv.check_invariants()
    assert kv.allocate("a", 18, 1) and kv.block_table("a") == [0, 0, 0, 6, 7]
    with pytest.raises(ValueError, match="already has blocks"):
        kv.resume("a", 18)


def test_without_a_window_nothing_is_freed_and_no_block_is_reserved():
    kv = KVCacheManager(8, BS)
    tokens = list(range(30))
    prefill(kv, "a", tokens)
    assert kv.null_block is None and kv.num_usable_blocks == 8
    assert not kv.free_skipped("a", 30) and kv.skipped_blocks(30) == 0
    assert kv.block_table("a") == list(range(8)) and kv.source_blocks("a", 30) == list(range(8))
