"""Where the model repository is, and whose adapters its multi_lora.json lists."""

import json

from loraplex.config import EngineConfig
from loraplex.triton.model_config import generate_model_multi_lora, multi_lora_for
from test_multi_lora_shapes import base, peft


def repository(tmp_path):
    model = tmp_path / "lora_llm"
    (model / "1").mkdir(parents=True)
    base(tmp_path / "base")
    for name in ("demo-a", "demo-b"):
        peft(tmp_path / "adapters" / name)
    (model / "1" / "multi_lora.json").write_text(json.dumps({"demo-a": "../../adapters/demo-a"}))
    return model, {"parameters": {"model_dir": {"string_value": "../base"}}}


def test_the_configured_model_gets_its_adapters(tmp_path):
    model, config = repository(tmp_path)
    engine = EngineConfig(model_dir=str(tmp_path / "base"))
    assert multi_lora_for(config, model, "1", engine) == {"demo-a": str((tmp_path / "adapters" / "demo-a").resolve())}


def test_another_base_model_gets_those_that_fit_it(tmp_path):
    model, config = repository(tmp_path)
    base(tmp_path / "wider", hidden_size=96)
    assert multi_lora_for(config, model, "1", EngineConfig(model_dir=str(tmp_path / "wider"))) == {}
    base(tmp_path / "same-shapes")
    assert list(multi_lora_for(config, model, "1", EngineConfig(model_dir=str(tmp_path / "same-shapes")))) == ["demo-a"]


def test_lora_adapters_reads_the_latest_lora_llm_versions_adapters(tmp_path):
    model, config = repository(tmp_path)
    (model / "2").mkdir()
    (model / "2" / "multi_lora.json").write_text(json.dumps({"demo-b": "../../adapters/demo-b"}))
    (tmp_path / "lora_adapters").mkdir()
    engine = EngineConfig(model_dir=str(tmp_path / "base"))
    assert list(generate_model_multi_lora(config, tmp_path / "lora_adapters", engine)) == ["demo-b"]
    assert generate_model_multi_lora(config, tmp_path / "lora_adapters", engine, "missing") == {}


def test_loraplex_home_names_the_project_root(monkeypatch, tmp_path):
    from loraplex.launch.tritonserver import project_root

    monkeypatch.setenv("LORAPLEX_HOME", str(tmp_path))
    assert project_root() == tmp_path
    monkeypatch.delenv("LORAPLEX_HOME")
    assert (project_root() / "pyproject.toml").is_file()  # the source checkout
