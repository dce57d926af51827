"""docs/security.md names, for each threat and each input of its inventory, the test that shows the control: every
test it names exists, runs (no skip or xfail mark, no skip call) and asserts something.

What "asserts something" means, read from the source with ``ast``: the test's body, or a function it calls that is
defined in its module or imported from a module under tests/ (followed to any depth), holds an ``assert`` whose
condition is not a constant, a ``pytest.raises`` / ``pytest.fail``, or a call to a function named ``assert_*``
(``assert_linear``, ``numpy.testing.assert_*``, ``torch.testing.assert_close``). A skip decided at run time by a
fixture or a hook is not seen here: tests/conftest.py skips nothing.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests"
SECURITY = ROOT / "docs" / "security.md"
INVENTORY = "## Inventory: what a caller can make the server parse, compile, match or compute over"
INVENTORY_COLUMNS = ["input", "runs on", "bound", "test"]
NAMED = re.compile(r"`((?:[\w/]+/)?test_\w+\.py)((?:::\w+)?)`|`(::\w+)`")  # a file (::test), or ::test after one
SKIPPING = {"skip", "skipif", "xfail", "importorskip"}
ASSERTING_CALLS = {"raises", "fail"}  # pytest.raises, pytest.fail
NO_BOUND = {"", "-", "—", "none", "unbounded", "?", "tbd"}


@dataclass
class Module:
    """One test or support module: its functions by name and the modules its names come from."""

    path: Path
    root: Path  # the tests/ folder it belongs to
    tree: ast.Module
    functions: dict[str, ast.FunctionDef | ast.AsyncFunctionDef] = field(default_factory=dict)
    imported: dict[str, tuple[str, str | None]] = field(default_factory=dict)  # local name -> (module, attribute)


@cache
def load(path: Path, root: Path = TESTS) -> Module:
    tree = ast.parse(path.read_text(), filename=str(path))
    module = Module(path, root, tree)
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            module.functions[node.name] = node
        elif isinstance(node, ast.ClassDef) and node.name.startswith("Test"):
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    module.functions.setdefault(item.name, item)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for alias in node.names:
                module.imported[alias.asname or alias.name] = (node.module, alias.name)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                module.imported[alias.asname or alias.name.split(".")[0]] = (alias.name, None)
    return module


def module_file(dotted: str, near: Path, root: Path) -> Path | None:
    """The file under tests/ (``root``) a module name imports (beside ``near``, support/, tests/), if it is ours."""
    relative = Path(*dotted.split(".")).with_suffix(".py")
    for base in (near.parent, root / "support", root):
        if (base / relative).is_file():
            return base / relative
    return None


def _names(node: ast.AST) -> set[str]:
    """Every name and attribute name in an expression (``pytest.mark.skipif(...)`` gives pytest, mark, skipif)."""
    found = set()
    for sub in ast.walk(node):
        if isinstance(sub, ast.Name):
            found.add(sub.id)
        elif isinstance(sub, ast.Attribute):
            found.add(sub.attr)
    return found


def _called_name(call: ast.Call) -> str | None:
    func = call.func
    return func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None


def skipped(module: Module, func: ast.FunctionDef | ast.AsyncFunctionDef) -> str | None:
    """Why the test may not run: a skip/xfail mark on it, its class or its module, or a skip call in its body."""
    for node in module.tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) \
            else []
        if any(isinstance(t, ast.Name) and t.id == "pytestmark" for t in targets) and _names(node.value) & SKIPPING:
            return "a module-level pytestmark skips or xfails it"
        if isinstance(node, ast.ClassDef) and func in node.body:
            if any(_names(d) & SKIPPING for d in node.decorator_list):
                return f"its class {node.name} is marked skip/xfail"
            for item in node.body:
                if isinstance(item, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "pytestmark"
                                                        for t in item.targets) and _names(item.value) & SKIPPING:
                    return f"its class {node.name}'s pytestmark skips or xfails it"
    for decorator in func.decorator_list:
        if _names(decorator) & SKIPPING:
            return f"it is marked {ast.unparse(decorator)[:80]}"
    for node in ast.walk(func):
        if isinstance(node, ast.Call) and _called_name(node) in SKIPPING and "pytest" in _names(node.func):
            return f"its body calls {ast.unparse(node.func)}"
    return None


def _asserts_directly(func: ast.AST) -> bool:
    for node in ast.walk(func):
        if isinstance(node, ast.Assert) and not isinstance(node.test, ast.Constant):
            return True
        if isinstance(node, ast.Call):
            name = _called_name(node)
            if name in ASSERTING_CALLS and "pytest" in _names(node.func):
                return True
            if name and name.startswith("assert_"):
                return True
    return False


def _callee(module: Module, call: ast.Call) -> tuple[Module, ast.FunctionDef | ast.AsyncFunctionDef] | None:
    """The test-tree function a call runs: one of the module's, or one imported from a module under tests/."""
    func = call.func
    if isinstance(func, ast.Name):
        if func.id in module.functions:
            return module, module.functions[func.id]
        source = module.imported.get(func.id)
        dotted, attribute = source if source else (None, None)
    elif isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id in module.imported:
        dotted, attribute = module.imported[func.value.id][0], func.attr
    else:
        return None
    path = module_file(dotted, module.path, module.root) if dotted and attribute else None
    if path is None:
        return None
    other = load(path, module.root)
    found = other.functions.get(attribute)
    return (other, found) if found is not None else None


def asserts(module: Module, func: ast.AST, seen: set | None = None) -> bool:
    """Whether ``func``, or a test-tree function it calls (to any depth), asserts something."""
    seen = set() if seen is None else seen
    if id(func) in seen:
        return False
    seen.add(id(func))
    if _asserts_directly(func):
        return True
    for node in ast.walk(func):
        if isinstance(node, ast.Call) and (callee := _callee(module, node)) is not None:
            if asserts(*callee, seen):
                return True
    return False


def problem(path: str, test: str, root: Path = TESTS) -> str | None:
    """What is wrong with the test ``tests/<path>::<test>`` as evidence (None: it exists, runs and asserts);
    a file named alone stands for every test in it."""
    source = root / path
    if not source.is_file():
        return f"{path}: no such file"
    module = load(source, root)
    if not test:
        tests = [name for name in module.functions if name.startswith("test")]
        if not tests:
            return f"{path}: no test in it"
        return next((why for name in tests if (why := problem(path, name, root))), None)
    func = module.functions.get(test)
    if func is None:
        return f"{path}::{test}: no such test"
    why = skipped(module, func)
    if why:
        return f"{path}::{test}: {why}"
    if not asserts(module, func):
        return f"{path}::{test}: asserts nothing (no assert, pytest.raises, pytest.fail or assert_* call, " \
               "in it or in the test-tree functions it calls)"
    return None


def named_tests(text: str) -> list[tuple[str, str]]:
    """(file, test or "") for each test named in ``text``; a bare `::name` belongs to the file named before it
    on the same line."""
    named = []
    for line in text.splitlines():
        current = None
        for path, test, follow_up in NAMED.findall(line):
            if path:
                current = path
                named.append((path, test[2:]))
            else:
                assert current is not None, f"{follow_up} without a file before it: {line[:120]}"
                named.append((current, follow_up[2:]))
    return named


def test_every_test_the_threat_model_names_exists_runs_and_asserts():
    named = named_tests(SECURITY.read_text())
    assert len(named) > 20, named
    problems = [why for path, test in dict.fromkeys(named) if (why := problem(path, test))]
    assert not problems, "\n".join(problems)


def inventory_rows(text: str) -> list[dict[str, str]]:
    """The inventory table's rows as {column: cell}; fails unless the section and its columns are there."""
    assert INVENTORY in text, f"docs/security.md has no section {INVENTORY!r}"
    section = text.split(INVENTORY, 1)[1].split("\n## ", 1)[0]
    table = [line for line in section.splitlines() if line.startswith("|")]
    assert len(table) >= 3, "the inventory has no table (a header, its |---| line and a row at least)"
    header = [cell.strip() for cell in table[0].strip("|").split("|")]
    assert header == INVENTORY_COLUMNS, f"the inventory's columns are {header}, not {INVENTORY_COLUMNS}"
    rows = []
    for line in table[2:]:
        cells = [cell.strip() for cell in re.split(r"(?<!\\)\|", line.strip().strip("|"))]
        assert len(cells) == len(header), f"a row with {len(cells)} cells, not {len(header)}: {line[:120]}"
        rows.append(dict(zip(header, cells)))
    return rows


def test_each_input_of_the_inventory_has_where_it_runs_a_bound_and_a_real_test():
    rows = inventory_rows(SECURITY.read_text())
    assert len(rows) >= 10, f"only {len(rows)} inputs in the inventory"
    problems = []
    for row in rows:
        what = row["input"][:60]
        if not row["input"] or not row["runs on"]:
            problems.append(f"{what!r}: no input or no 'runs on'")
        if row["bound"].strip("`* ").lower() in NO_BOUND:
            problems.append(f"{what!r}: no bound")
        tests = named_tests(row["test"])
        if not any(test for _, test in tests):
            problems.append(f"{what!r}: names no test (`path.py::test_name`)")
        problems += [f"{what!r}: {why}" for path, test in tests if (why := problem(path, test))]
    assert not problems, "\n".join(problems)


FAKE_SUPPORT = """
def check(value):
    assert value == 1
"""
FAKE_TESTS = """
import pytest
from fake_support import check


def _local(x):
    assert x


def test_asserts():
    assert 1 + 1 == 2


def test_raises():
    with pytest.raises(ValueError):
        int("x")


def test_through_a_local_helper():
    _local(3)


def test_through_a_support_helper():
    check(1)


def test_assert_call():
    assert_linear(None, 1)


@pytest.mark.skip(reason="later")
def test_skipped():
    assert 1


@pytest.mark.skipif(True, reason="never")
def test_skipif():
    assert 1


@pytest.mark.parametrize("x", [1, pytest.param(2, marks=pytest.mark.xfail)])
def test_a_param_xfails(x):
    assert x


def test_skips_itself():
    pytest.skip("not today")
    assert 1


def test_nothing():
    int("1")


def test_a_constant():
    assert True


class TestGroup:
    def test_in_a_class(self):
        assert 2 > 1
"""


def test_the_rule_refuses_skipped_xfailed_and_assertless_tests(tmp_path):
    (tmp_path / "support").mkdir()
    (tmp_path / "unit").mkdir()
    (tmp_path / "support" / "fake_support.py").write_text(FAKE_SUPPORT)
    (tmp_path / "unit" / "test_fake.py").write_text(FAKE_TESTS)
    (tmp_path / "unit" / "test_marked.py").write_text("import pytest\npytestmark = [pytest.mark.skipif(True, "
                                                      "reason='x')]\n\n\ndef test_a():\n    assert 1 == 1\n")
    good = ["test_asserts", "test_raises", "test_through_a_local_helper", "test_through_a_support_helper",
            "test_assert_call", "test_in_a_class"]
    assert {name: problem("unit/test_fake.py", name, tmp_path) for name in good} == dict.fromkeys(good)
    bad = {"test_skipped": "it is marked pytest.mark.skip(reason='later')",
           "test_skipif": "it is marked pytest.mark.skipif(True, reason='never')",
           "test_a_param_xfails": "it is marked pytest.mark.parametrize('x', [1, pytest.param(2, marks=pytest.mark.xf",
           "test_skips_itself": "its body calls pytest.skip",
           "test_nothing": "asserts nothing", "test_a_constant": "asserts nothing", "test_missing": "no such test"}
    for name, why in bad.items():
        assert why in (problem("unit/test_fake.py", name, tmp_path) or ""), name
    assert "a module-level pytestmark skips or xfails it" in problem("unit/test_marked.py", "test_a", tmp_path)
    assert "test_skipped" in problem("unit/test_fake.py", "", tmp_path)  # a file alone: each of its tests
    assert problem("unit/test_none.py", "", tmp_path) == "unit/test_none.py: no such file"


def test_names_are_read_in_order_and_a_bare_follow_up_belongs_to_the_file_before_it():
    line = "| x | y | `unit/test_a.py::test_one`, `::test_two`, `e2e/test_b.py`, `::test_three` |"
    assert named_tests(line) == [("unit/test_a.py", "test_one"), ("unit/test_a.py", "test_two"),
                                 ("e2e/test_b.py", ""), ("e2e/test_b.py", "test_three")]


def test_the_inventory_table_is_read_by_its_columns():
    text = (f"# S\n\n{INVENTORY}\n\n| input | runs on | bound | test |\n|---|---|---|---|\n"
            "| a \\| b | event loop | 1 MiB | `unit/test_security_doc.py::test_the_inventory_table_is_read_by_its_columns` |"
            "\n\n## Next\n| not | this |\n")
    assert inventory_rows(text) == [{"input": "a \\| b", "runs on": "event loop", "bound": "1 MiB",
                                     "test": "`unit/test_security_doc.py::test_the_inventory_table_is_read_by_its_columns`"}]
