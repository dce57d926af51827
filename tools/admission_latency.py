"""Tenant B's admission latency while tenant A floods max-size prompts, with a real tokenizer (docs/decisions/013).

Usage: python tools/admission_latency.py [MODEL_DIR] [MAX_MODEL_LEN]
"""

from __future__ import annotations

import statistics
import sys
import threading
import time

from transformers import AutoTokenizer

from loraplex.engine.prompt_bound import longest_token_bytes
from loraplex.triton.admission import AdmissionPool, Job


def main(model_dir: str = ".cache/smollm2/model", max_model_len: int = 8192) -> None:
    """Print the byte bound, a max-size prompt's tokenizing time, and B's latency inline vs on the pool."""
    tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    bound = max_model_len * longest_token_bytes(tok)
    big = ("The quick brown fox jumps over the lazy dog. " * (bound // 45 + 1))[:bound]
    two_mb = big * (2_000_000 // len(big) + 1)
    t0 = time.perf_counter()
    tok(two_mb[:2_000_000])
    print(f"2 MB prompt tokenized in {time.perf_counter() - t0:.2f} s")
    t0 = time.perf_counter()
    tok(big)
    one = time.perf_counter() - t0
    print(f"byte bound {bound} bytes ({max_model_len} x {bound // max_model_len}); a max-size prompt: {one:.2f} s")
    pool, latencies = AdmissionPool(workers=2), []
    for _ in range(8):
        pool.submit(Job("A", len(big), lambda: tok(big), lambda exc: None))
    for _ in range(10):
        done = threading.Event()
        start = time.perf_counter()
        pool.submit(Job("B", 5, lambda: (tok("Hello"), done.set()), lambda exc: None))
        done.wait(30)
        latencies.append(time.perf_counter() - start)
        time.sleep(0.05)
    print(f"B's admission under A's flood of 8 max-size prompts, 2 workers: median {statistics.median(latencies)*1e3:.1f} ms, "
          f"max {max(latencies)*1e3:.1f} ms (inline on one thread it would wait up to {8 * one:.1f} s)")
    pool.close()


if __name__ == "__main__":
    main(*(sys.argv[1:2] or []), *(int(a) for a in sys.argv[2:3]))
