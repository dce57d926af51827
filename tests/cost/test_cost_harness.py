"""The cost harness itself: it passes a linear cost, and fails a quadratic one, a memory bomb and a hang."""

import re

import pytest
from cost_harness import assert_linear

_BACKTRACKING = re.compile(r"([\w-]+)\s*=\s*([^;\s]+)")  # the shape of the gateway's old multipart token regex


def linear_scan(n: int):
    text = "a" * (n * 1024)
    return lambda: text.count("b")


def quadratic_backtracking(n: int):
    text = "a" * (n * 1024)  # no '=': each start position rescans the rest
    return lambda: list(_BACKTRACKING.finditer(text))


def memory_bomb(n: int):
    return lambda: bytearray(n * 1024 * 1024 * 1024)


def hang(n: int):
    import time

    return lambda: time.sleep(60)


def test_a_linear_case_passes():
    assert_linear(linear_scan, 4096, max_seconds=1.0)


def test_a_quadratic_case_fails():
    with pytest.raises(AssertionError, match="super-linear|over its bound"):
        assert_linear(quadratic_backtracking, 4, max_seconds=30.0, repeats=1)


def test_a_memory_bomb_fails_in_its_child():
    with pytest.raises(AssertionError, match="failed in its child"):
        assert_linear(memory_bomb, 8, max_seconds=5.0, mem_mb=1024, repeats=1)


def test_a_hang_fails_at_the_wall_clock_bound():
    with pytest.raises(AssertionError, match="ran past"):
        assert_linear(hang, 1, max_seconds=1.0, timeout_s=2.0, repeats=1)
