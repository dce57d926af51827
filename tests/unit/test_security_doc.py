"""docs/security.md names, for each threat, the test that shows its control: every one it names exists."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_every_test_the_threat_model_names_exists():
    text = (ROOT / "docs" / "security.md").read_text()
    named = re.findall(r"`((?:[\w/]+/)?test_\w+\.py)((?:::\w+)?)`", text)
    assert len(named) > 20, named
    for path, test in named:
        source = ROOT / "tests" / path
        assert source.is_file(), path
        if test:
            assert re.search(rf"^(async )?def {test[2:]}\(", source.read_text(), re.M), f"{path}{test}"
    for follow_up in re.findall(r"`(::\w+)`", text):  # `::name` after a named file: checked with that file
        assert any(re.search(rf"^(async )?def {follow_up[2:]}\(", (ROOT / "tests" / p).read_text(), re.M)
                   for p, _ in named), follow_up
