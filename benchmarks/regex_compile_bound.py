"""What the regex package's compile costs on adapter-config patterns, and the worst case the bound lets through.

Part 1 compiles hostile patterns (nested counted repeats) with ``regex`` and ``re`` in a child process under a
memory rlimit, as loraplex compiled them before decision 060. Part 2 generates random patterns of nested repeats
that pass ``check_pattern``'s bounds (at most MAX_REGEX_SIZE atoms unrolled, repeats that unroll at most
MAX_REGEX_REPEAT_DEPTH deep, 256 characters) plus the shapes found worst by hand, compiles each with ``regex``,
and prints the slowest.

    python benchmarks/regex_compile_bound.py [--patterns 3000] [--seed 0] [--mem-mb 3072]
"""

from __future__ import annotations

import argparse
import random
import resource
import subprocess
import sys
import time

HOSTILE = [
    "(?:(?:(?:a{200}){200}){200})",  # issue 39's: 29 characters
    "(?:a{1000}){1000}",
    "(?:" * 12 + "a" + "){2}" * 12,  # 4,096 atoms, 12 deep
    "(?:" * 10 + "a??" + "){2}" * 10,  # 1,024 atoms, 10 deep
    "(?:" * 18 + "ab" + ")+?" * 18,
]
ATOMS = ["a", "ab", "abcd", "abcdefgh", ".", "[ab]", "[a-z0-9_]", r"\d", r"\w", "a|b", "a?", "a??", "a?b?", "(a)?",
         "(?:a|bc|d)", ".*", "a+?", "x*y", "(a)", "(?=a)", "[^.]", "(?:a|)"]


def _compile_in_child(pattern: str, mem_mb: int) -> str:
    code = ("import sys, time, resource, re, regex\n"
            "p = sys.argv[1]\n"
            "t = time.perf_counter(); re.compile(p); r = time.perf_counter() - t\n"
            "t = time.perf_counter(); regex.compile(p); x = time.perf_counter() - t\n"
            "print(f're {r * 1e3:.2f} ms, regex {x:.3f} s, '\n"
            "      f'{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024} MiB peak')\n")

    def limit():
        resource.setrlimit(resource.RLIMIT_AS, (mem_mb << 20, mem_mb << 20))

    try:
        done = subprocess.run([sys.executable, "-c", code, pattern], capture_output=True, text=True, timeout=120,
                              preexec_fn=limit)
    except subprocess.TimeoutExpired:
        return "over 120 s"
    if done.returncode != 0:
        return f"died ({done.stderr.strip().splitlines()[-1][:60]}) under {mem_mb} MiB"
    return done.stdout.strip()


def _nested(depth: int) -> str:
    if depth == 0:
        return random.choice(ATOMS)
    count = random.choice([2, 2, 3, 4, 5, 6, 8, 16, 32, 50, 100, 1000])
    form = random.choice(["{%d}", "{%d}", "{1,%d}", "{%d,}", "{0,%d}", "{%d}?", "{%d}+"]) % count
    return "(?:" + _nested(depth - 1) + random.choice(["", "", "b", "|c", r"\."]) + ")" + form


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--patterns", type=int, default=3000, help="random patterns to try")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--mem-mb", type=int, default=3072, help="memory rlimit of part 1's children")
    args = parser.parse_args(argv)
    import regex

    from loraplex.exceptions import AdapterError
    from loraplex.lora.patterns import MAX_REGEX_REPEAT_DEPTH, MAX_REGEX_SIZE, check_pattern, expanded_size

    print("part 1: hostile patterns, compiled as before decision 060")
    for pattern in HOSTILE:
        size, depth = expanded_size(pattern)
        print(f"  {pattern[:44]:<44} atoms {'>' if size > MAX_REGEX_SIZE else ''}{min(size, MAX_REGEX_SIZE)} "
              f"depth {depth}: {_compile_in_child(pattern, args.mem_mb)}")
    random.seed(args.seed)
    candidates = [_nested(random.randint(1, 8)) for _ in range(args.patterns)]
    for k in range(1, MAX_REGEX_REPEAT_DEPTH + 1):
        for atom in ATOMS:
            for count in (2, 3, 4, 5, 6, 8):
                candidates += ["(?:" * k + atom + "){%d}" % count * k, "(?:" * k + atom + "){1,%d}" % count * k]
    candidates += ["a{%d}" % MAX_REGEX_SIZE, "(?:a?){%d}" % MAX_REGEX_SIZE, r"(?:.*?\.){%d}" % (MAX_REGEX_SIZE // 4)]
    timed = []
    for pattern in candidates:
        try:
            check_pattern("target_modules", pattern, "bench")
        except AdapterError:
            continue
        regex.purge()
        start = time.perf_counter()
        regex.compile(pattern)
        timed.append((time.perf_counter() - start, pattern))
    timed.sort(reverse=True)
    print(f"part 2: {len(timed)} patterns within the bounds ({MAX_REGEX_SIZE} atoms, {MAX_REGEX_REPEAT_DEPTH} deep); "
          f"slowest regex.compile:")
    for seconds, pattern in timed[:5]:
        print(f"  {seconds * 1e3:7.2f} ms  {expanded_size(pattern)}  {pattern[:90]}")


if __name__ == "__main__":
    main()
