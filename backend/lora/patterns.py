"""The regexes an adapter's config carries (target_modules, exclude_modules, rank_pattern and alpha_pattern keys,
layers_pattern): checked before anything compiles them, then matched under one budget of matching time per adapter
load (the time the load spends elsewhere, reading and checking tensors on a busy machine, is not the patterns').

A pattern is tenant input. Compiling one is not free: the regex package unrolls counted repeats, so 29 characters
of nested ``{200}`` take seconds and gigabytes. ``check_pattern`` therefore parses it with the standard library's
parser (linear in the pattern's length; it keeps counts as numbers and expands nothing), bounds its expanded size
(nested repeat counts multiplied, times the atoms they repeat), and only then compiles it with ``re`` (what peft
accepts) and ``regex`` (what matches, with a timeout). Decision 060.
"""

from __future__ import annotations

import re
import time

import regex

try:
    from re import _parser as sre_parse  # Python 3.11+
    from re import _constants as sre
except ImportError:  # Python 3.10
    import sre_constants as sre
    import sre_parse

from loraplex.exceptions import AdapterError

MAX_REGEX_CHARS = 256  # a tenant-supplied pattern (target/exclude_modules, rank/alpha_pattern keys, layers_pattern)
MAX_REGEX_SIZE = 1024  # atoms a pattern holds with every counted repeat unrolled (peft's real ones: under 300)
MAX_REGEX_REPEAT_DEPTH = 4  # repeats that unroll (a count of 2 or more, or +) nested in each other
WRAPPED_SIZE = MAX_REGEX_SIZE + 64  # a config pattern inside peft's wrapping (layers_pattern, rank/alpha_pattern)
REGEX_BUDGET_SECONDS = 0.5  # all pattern matching of one adapter load together

_REPEATS = {sre.MAX_REPEAT, sre.MIN_REPEAT} | ({sre.POSSESSIVE_REPEAT} if hasattr(sre, "POSSESSIVE_REPEAT") else set())
_ATOMIC = getattr(sre, "ATOMIC_GROUP", None)
_BRACE = ord("{")


def expanded_size(pattern: str, limit: int = MAX_REGEX_SIZE) -> tuple[int, int]:
    """(atoms in ``pattern`` with every repeat unrolled, capped at ``limit + 1``; how deep repeats that unroll
    nest). An unbounded repeat counts once past its minimum; one that unrolls has a count of 2 or more. Raises
    re.error for a pattern ``re`` refuses. Linear in the pattern's length."""
    size, depth = _measure(sre_parse.parse(pattern), limit)
    return min(size, limit + 1), depth


def _measure(items, limit: int) -> tuple[int, int]:
    total = deepest = 0
    for op, av in items:
        depth = 0
        if op in _REPEATS:
            lo, hi, sub = av
            count = max(lo + 1 if hi == sre.MAXREPEAT else hi, 1)
            size, inner = _measure(sub, limit)
            size, depth = count * size, inner + (count > 1)
        elif op is sre.SUBPATTERN:
            size, depth = _measure(av[-1], limit)
        elif op is sre.BRANCH:
            parts = [_measure(branch, limit) for branch in av[1]]
            size, depth = sum(p[0] for p in parts), max(p[1] for p in parts)
        elif op in (sre.ASSERT, sre.ASSERT_NOT):
            size, depth = _measure(av[1], limit)
        elif op is sre.GROUPREF_EXISTS:
            parts = [_measure(branch, limit) for branch in av[1:] if branch]
            size, depth = sum(p[0] for p in parts), max(p[1] for p in parts)
        elif _ATOMIC is not None and op is _ATOMIC:
            size, depth = _measure(av, limit)
        elif op is sre.IN:
            size = max(1, len(av))
        else:
            size = 1
        total, deepest = min(total + size, limit + 1), max(deepest, depth)  # counts multiply: keep them small
    return total, deepest


def _has_literal_brace(items) -> bool:
    """Whether a '{' is read as a literal outside a character class (the regex package may read fuzzy matching)."""
    stack = [items]
    while stack:
        for op, av in stack.pop():
            if op is sre.LITERAL and av == _BRACE:
                return True
            if op in _REPEATS:
                stack.append(av[2])
            elif op is sre.SUBPATTERN:
                stack.append(av[-1])
            elif op is sre.BRANCH:
                stack.extend(av[1])
            elif op in (sre.ASSERT, sre.ASSERT_NOT):
                stack.append(av[1])
            elif op is sre.GROUPREF_EXISTS:
                stack.extend(b for b in av[1:] if b)
            elif _ATOMIC is not None and op is _ATOMIC:
                stack.append(av)
    return False


def check_pattern(field: str, pattern: str, where: str) -> None:
    """Refuse a config regex that is too long, invalid for ``re`` (peft), or too big once its repeats are
    unrolled, before it is compiled; AdapterError naming the field."""
    shown = pattern if len(pattern) <= 60 else pattern[:60] + "..."
    if len(pattern) > MAX_REGEX_CHARS:
        raise AdapterError(f"{where}: {field} pattern is {len(pattern)} characters long; "
                           f"at most {MAX_REGEX_CHARS} are allowed")
    try:
        parsed = sre_parse.parse(pattern)
    except (re.error, RecursionError, OverflowError) as exc:
        raise AdapterError(f"{where}: {field} pattern {shown!r} is not a valid regex: {exc}") from None
    size, depth = _measure(parsed, MAX_REGEX_SIZE)
    if size > MAX_REGEX_SIZE:
        raise AdapterError(f"{where}: {field} pattern {shown!r} expands past {MAX_REGEX_SIZE} atoms with its counted "
                           f"repeats unrolled; module names need no such counts (use + or * instead)")
    if depth > MAX_REGEX_REPEAT_DEPTH:
        raise AdapterError(f"{where}: {field} pattern {shown!r} nests counted repeats {depth} deep; at most "
                           f"{MAX_REGEX_REPEAT_DEPTH} are allowed")
    if _has_literal_brace(parsed):
        raise AdapterError(f"{where}: {field} pattern {shown!r} has a '{{' that is not a repeat count; module names "
                           f"have none (and the regex package would read it as fuzzy matching)")
    try:
        re.compile(pattern)  # what peft accepts
        regex.compile(pattern)  # what we match with (under a time budget)
    except (re.error, regex.error) as exc:
        raise AdapterError(f"{where}: {field} pattern {shown!r} is not a valid regex: {exc}") from None


class Patterns:
    """Config regexes (each passed check_pattern) matched with the regex package, all the matches of one adapter
    load within one budget of seconds spent matching; each as peft wraps it is bounded again before it is
    compiled."""

    def __init__(self, where: str, budget: float = REGEX_BUDGET_SECONDS):
        self.where, self.budget = where, budget
        self.left = budget  # matching time left to this load
        self._compiled: dict[str, regex.Pattern] = {}

    def _run(self, field: str, pattern: str, method: str, key: str):
        compiled = self._compiled.get(pattern)
        if compiled is None:
            try:
                size, depth = expanded_size(pattern, WRAPPED_SIZE)
            except (re.error, RecursionError, OverflowError) as exc:  # peft's re.match raises it too
                shown = pattern if len(pattern) <= 80 else pattern[:80] + "..."
                raise AdapterError(f"{self.where}: {field} pattern is not a valid regex as peft applies it "
                                   f"({shown!r}): {exc}") from None
            if size > WRAPPED_SIZE or depth > MAX_REGEX_REPEAT_DEPTH:
                raise AdapterError(f"{self.where}: {field} pattern expands past {MAX_REGEX_SIZE} atoms or nests "
                                   f"counted repeats past {MAX_REGEX_REPEAT_DEPTH} deep as peft applies it")
            compiled = self._compiled[pattern] = regex.compile(pattern)
        start = time.monotonic()
        try:
            if self.left <= 0:
                raise TimeoutError
            return getattr(compiled, method)(key, timeout=self.left)
        except TimeoutError:
            raise AdapterError(
                f"{self.where}: matching the {field} patterns took longer than {self.budget:g} s; "
                f"simplify them (catastrophic backtracking?)"
            ) from None
        finally:
            self.left -= time.monotonic() - start

    def fullmatch(self, field: str, pattern: str, key: str):
        """re.fullmatch(pattern, key), bounded by the budget left."""
        return self._run(field, pattern, "fullmatch", key)

    def match(self, field: str, pattern: str, key: str):
        """re.match(pattern, key), bounded by the budget left."""
        return self._run(field, pattern, "match", key)

    def in_layers(self, layers_to_transform: list[int] | None, layers_pattern: list[str] | None, key: str) -> bool:
        """peft's layers_to_transform check for one full module name (layers_pattern: where the index sits)."""
        if layers_to_transform is None:
            return True
        if layers_pattern is None:
            found = re.match(r".*?\.[^.]*\.(?P<idx>\d+)\.", key)
        else:
            found = None
            for pattern in layers_pattern:
                found = self.match("layers_pattern", rf"(?:^|.*?\.){pattern}\.(?P<idx>\d+)\.", key)
                if found:
                    break
        return found is not None and int(found.group("idx")) in layers_to_transform
