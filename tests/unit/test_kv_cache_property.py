"""Stateful property test of KVCacheManager against a model of what each KV slot holds.

A slot's modeled content is (namespace, every token up to and including that position),
which is what real K/V depend on. After every step each live sequence must read back its
own history through its block table: this catches a wrong prefix hit (hash chain,
namespace, collision), a missed or wrong copy-on-write, and a write into a shared block.
"""

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from kv_snapshot import snapshot

from loraplex.kv_cache import KVCacheManager, namespace_key

NUM_BLOCKS = 12
BS = 3
NAMESPACES = [namespace_key("t1", "d1"), namespace_key("t2", "d1"), namespace_key("t1", None)]
tokens_st = st.lists(st.integers(0, 1), min_size=1, max_size=NUM_BLOCKS * BS // 3)


class KVCacheMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.kv = KVCacheManager(NUM_BLOCKS, BS)
        self.content = [[None] * BS for _ in range(NUM_BLOCKS)]
        self.seqs = {}  # seq_id -> [tokens, num_computed, namespace]
        self.history = []  # (prompt, namespace) of past admissions, to provoke hits
        self.next_id = 0
        self.hits = 0

    # ---------------------------------------------------------------- helpers

    def _snapshot(self):
        return snapshot(self.kv)

    def _compute(self, seq_id, n):
        """Apply pending copies, write n tokens' KV from the seq's computed position, register full blocks."""
        tokens, computed, ns = self.seqs[seq_id]
        for src, dst in self.kv.take_copy_pairs():
            self.content[dst] = list(self.content[src])
        table = self.kv.block_table(seq_id)
        for p in range(computed, computed + n):
            self.content[table[p // BS]][p % BS] = (ns, tuple(tokens[: p + 1]))
        self.seqs[seq_id][1] = computed + n
        self.kv.cache_full_blocks(seq_id, tokens, computed + n, ns)

    def _admit(self, prompt, ns, chunk):
        blocks, covered = self.kv.find_cached_prefix(prompt, ns)
        assert covered == len(blocks) * BS and covered < len(prompt)
        n = min(chunk, len(prompt) - covered)
        seq_id = self.next_id
        before = self._snapshot()
        needed = self.kv.blocks_needed(seq_id, covered, n, blocks)
        can = self.kv.can_allocate(needed)
        ok = self.kv.allocate(seq_id, covered, n, blocks)
        assert ok == can == (needed <= before[5]["free"])
        if not ok:
            assert self._snapshot() == before
            return
        assert self.kv.usage()["free"] == before[5]["free"] - needed
        self.next_id += 1
        self.hits += bool(blocks)
        self.seqs[seq_id] = [list(prompt), covered, ns]
        self.history.append((list(prompt), ns))
        self._compute(seq_id, n)
        # every full block just computed (or hit) is findable now, in this namespace only
        done = prompt[: covered + n]
        probe = self.kv.find_cached_prefix(done + [7], ns)
        assert probe[1] == len(done) // BS * BS
        for other in NAMESPACES:
            if other != ns:
                assert all(
                    self.content[b][0][0] == other for b in self.kv.find_cached_prefix(done + [7], other)[0]
                )

    # ------------------------------------------------------------------ rules

    @rule(prompt=tokens_st, ns=st.sampled_from(NAMESPACES), chunk=st.integers(1, 16))
    def add(self, prompt, ns, chunk):
        self._admit(prompt, ns, chunk)

    @precondition(lambda self: self.history)
    @rule(data=st.data(), suffix=st.lists(st.integers(0, 3), max_size=4), chunk=st.integers(1, 16))
    def add_repeat(self, data, suffix, chunk):
        prompt, ns = data.draw(st.sampled_from(self.history))
        cut = data.draw(st.integers(0, len(prompt)))
        new = prompt[:cut] + suffix
        if new:
            self._admit(new, ns, chunk)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), n=st.integers(1, 5), new_tokens=st.lists(st.integers(0, 2), min_size=5, max_size=5))
    def step(self, data, n, new_tokens):
        seq_id = data.draw(st.sampled_from(sorted(self.seqs)))
        tokens, computed, _ = self.seqs[seq_id]
        if computed < len(tokens):
            n = min(n, len(tokens) - computed)  # chunked prefill goes on
        before = self._snapshot()
        needed = self.kv.blocks_needed(seq_id, computed, n)
        ok = self.kv.allocate(seq_id, computed, n)
        assert ok == (needed <= before[5]["free"])
        if not ok:
            assert self._snapshot() == before
            return
        assert self.kv.usage()["free"] == before[5]["free"] - needed
        if computed == len(tokens):
            tokens.extend(new_tokens[:n])  # decode / multi-token append
        self._compute(seq_id, n)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), n=st.integers(1, 3))
    def fork_and_step(self, data, n):
        self.fork(data)
        self.step(data, n, [0, 1, 2, 0, 1])

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def fork(self, data):
        parent = data.draw(st.sampled_from(sorted(self.seqs)))
        child = self.next_id
        self.next_id += 1
        self.kv.fork(parent, child)
        tokens, computed, ns = self.seqs[parent]
        self.seqs[child] = [list(tokens), computed, ns]

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def finish(self, data):
        self.free(data)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def free(self, data):
        seq_id = data.draw(st.sampled_from(sorted(self.seqs)))
        table = list(self.kv.block_table(seq_id))
        queue_before = self.kv.pool.free_queue.ids()
        self.kv.free(seq_id)
        del self.seqs[seq_id]
        released = [b for b in reversed(table) if self.kv.pool.blocks[b].ref_count == 0]
        assert self.kv.pool.free_queue.ids() == queue_before + released  # tail first, to the LRU tail

    @rule()
    def free_unknown(self):
        before = self._snapshot()
        self.kv.free("never-seen")
        assert self._snapshot() == before

    @rule(roll=st.integers(0, 9))
    def reset_prefix_cache(self, roll):
        if roll:  # rare: it throws the cache away
            return
        self.kv.reset_prefix_cache()
        assert self.kv.usage()["cached"] == 0

    # ------------------------------------------------------------- invariants

    @invariant()
    def consistent(self):
        kv = self.kv
        kv.check_invariants()
        assert kv.take_copy_pairs() == []  # every step consumed its copies
        for seq_id, (tokens, computed, ns) in self.seqs.items():
            table = kv.block_table(seq_id)
            assert len(table) * BS >= computed
            for p in range(computed):
                assert self.content[table[p // BS]][p % BS] == (ns, tuple(tokens[: p + 1])), (seq_id, p)
        # a cached block's stored tokens are what its slots hold
        for block in kv.pool.cached.values():
            slots = self.content[block.block_id]
            assert tuple(s[1][-1] for s in slots) == block.token_ids

    def teardown(self):
        for seq_id in list(self.seqs):
            self.kv.free(seq_id)
        self.kv.check_invariants()
        assert self.kv.num_free_blocks == NUM_BLOCKS
        assert self.kv.usage()["used"] == 0
        assert all(b.ref_count == 0 for b in self.kv.pool.blocks)


KVCacheMachine.TestCase.settings = settings(
    max_examples=200,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestKVCacheMachine = KVCacheMachine.TestCase
