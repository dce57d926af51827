"""The quantization knob's user surface (decision 072): loraplex-serve's --quantization and its refusal of a
checkpoint format not served before Triton starts; EngineConfig's check; the model-info gauge."""

from __future__ import annotations

import json

import pytest

from loraplex.config import EngineConfig
from loraplex.engine.metrics import EXPORTED_METRICS, model_info
from loraplex.models.quant.formats import CheckpointFormat
from loraplex.models.quant.plan import QuantPlan


def _checkpoint(tmp_path, demo, quantization_config: dict | None) -> str:
    folder = tmp_path / "model"
    folder.mkdir()
    config = json.loads((demo["model"] / "config.json").read_text())
    if quantization_config is not None:
        config["quantization_config"] = quantization_config
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


def test_serve_refuses_an_unserved_quantization_config_before_starting(tmp_path, demo, capsys):
    from loraplex.launch.serve import main

    model_dir = _checkpoint(tmp_path, demo, {"quant_method": "hqq", "nbits": 4})
    assert main(["--model-dir", model_dir, "--quantization", "int8"]) == 2
    err = capsys.readouterr().err
    assert f"loraplex-serve: --model-dir {model_dir}: quantization_config.quant_method 'hqq' is not served" in err


def test_serve_puts_quantization_into_the_engine_config(tmp_path, demo, capsys):
    """--quantization joins --engine-config's knobs (the engine reads them from LORAPLEX_ENGINE_CONFIG); a
    non-object engine config is refused naming it."""
    from loraplex.launch.serve import main

    assert main(["--quantization", "int8", "--engine-config", "[1]"]) == 2
    assert "--engine-config: not a JSON object" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--quantization", "int7"])
    assert "invalid choice: 'int7'" in capsys.readouterr().err
    with pytest.raises(ValueError, match="quantization must be auto, none, int8, fp8 or int4"):
        EngineConfig(quantization="int7")
    with pytest.raises(ValueError, match="quantization_fallback must be off or reference"):
        EngineConfig(quantization_fallback="dequantize")


def test_model_info_names_the_served_weights_and_the_checkpoint_method():
    assert "loraplex_model_info" in EXPORTED_METRICS
    assert model_info(QuantPlan()) == {("model_info", ("none", "none")): 1}
    assert model_info(QuantPlan("int8", "load")) == {("model_info", ("int8", "none")): 1}
    gptq = CheckpointFormat("int4", "gptq", "gptq int4 (group 128, gptq)", group_size=128)
    assert model_info(QuantPlan("int4", "checkpoint", gptq)) == {("model_info", ("int4", "gptq")): 1}
    assert model_info(QuantPlan("none", "dequantized", gptq)) == {("model_info", ("none", "gptq")): 1}
    assert QuantPlan("int4", "checkpoint", gptq).label == "int4: gptq int4 (group 128, gptq)"
