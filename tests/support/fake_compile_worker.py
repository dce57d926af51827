"""A compile worker without xgrammar, for tests of the pool (engine/compile_workers.py): the real worker's life
(set-up, rlimits, death with its parent) around a compile that does what the constraint's text says.

"spin": burns CPU until killed; "hog": allocates 8 GiB; "die": exits mid-compile; "bad...": refused;
"hold:<path>": waits until the file exists; "chatty": prints to stdout; anything else compiles at once. Each job's text is appended to the file named by LORAPLEX_FAKE_COMPILE_LOG (if set) as
it arrives.
"""

from __future__ import annotations

import os
import sys
import time

from loraplex.engine.compile_worker import serve


def _run(job: dict) -> None:
    spec = job["spec"]
    log = os.environ.get("LORAPLEX_FAKE_COMPILE_LOG")
    if log:
        with open(log, "a") as f:
            f.write(spec + "\n")
    if spec == "spin":
        while True:
            pass
    if spec == "hog":
        bytearray(8 << 30)
    if spec == "die":
        os._exit(3)
    if spec.startswith("hold:"):
        while not os.path.exists(spec[5:]):
            time.sleep(0.005)
    if spec == "chatty":
        print("a library printing to stdout")
    if spec.startswith("bad"):
        raise ValueError(f"cannot compile {spec!r}")


if __name__ == "__main__":
    sys.exit(serve(lambda init: _run, sys.argv))
