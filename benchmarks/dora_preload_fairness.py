"""A tenant cycling DoRA versions against another tenant's cold plain-LoRA load, on the adapter preloader.

In process, on SmolLM2-135M (or ``--model-dir``): mallory queues ``--versions`` DoRA adapters (rank 16, all
7 projections of every layer: each read computes ``B @ A`` and the row norms per module), then alice queues one
cold plain LoRA adapter (rank 8, q/v). The reads go through the real ``AdapterManager.read`` (parse, validate,
DoRA scales from the checkpoint's base weights) on the preloader, the one from 4fbff58 (FIFO) and the current
one (fair queuing per tenant, decision 060). Prints alice's load latency alone and behind mallory's queue.

    python benchmarks/dora_preload_fairness.py [--versions 8] [--model-dir .cache/smollm2/model]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import queue
import subprocess
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch
from safetensors.torch import load_file, save_file

ROOT = Path(__file__).resolve().parents[1]
MODULES = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
           "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


def write_adapter(folder: Path, cfg, shapes, modules, rank: int, dora: bool, seed: int) -> str:
    """A random peft-format adapter (DoRA: with magnitudes) for every layer's ``modules``."""
    folder.mkdir(parents=True)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(cfg.num_hidden_layers):
        for module in modules:
            in_f, out_f = shapes[module]
            prefix = f"base_model.model.model.layers.{layer}.{MODULES[module]}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, in_f, generator=gen) * 0.01
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(out_f, rank, generator=gen) * 0.01
            if dora:
                tensors[f"{prefix}.lora_magnitude_vector"] = torch.rand(out_f, generator=gen) + 0.5
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(modules),
              "use_dora": dora}
    (folder / "adapter_config.json").write_text(json.dumps(config))
    return str(folder)


def old_preloader():
    source = subprocess.run(["git", "show", "4fbff58:backend/lora/preloader.py"], cwd=ROOT, check=True,
                            capture_output=True, text=True).stdout
    path = Path(tempfile.mkdtemp()) / "preloader_4fbff58.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("preloader_4fbff58", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.AdapterPreloader


def alice_latency(preloader_class, manager, mallory: list[str], alice: str) -> float:
    """Seconds from alice's submit to her delivery, with mallory's reads queued just before."""
    done: queue.SimpleQueue = queue.SimpleQueue()
    preloader = preloader_class(manager.read, lambda req, got: done.put((req.tenant, time.perf_counter())))
    for i, folder in enumerate(mallory):
        preloader.submit(SimpleNamespace(tenant="mallory", request_id=f"m{i}"), f"mallory/dora@{i}", folder)
    start = time.perf_counter()
    preloader.submit(SimpleNamespace(tenant="alice", request_id="a"), "alice/plain@1", alice)
    when = None
    for _ in range(len(mallory) + 1):
        tenant, at = done.get(timeout=600)
        if tenant == "alice":
            when = at
    preloader.close()
    return when - start


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", default=str(ROOT / ".cache/smollm2/model"))
    parser.add_argument("--versions", type=int, default=8, help="DoRA versions mallory queues")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (the preloader shares the host)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    from loraplex.lora.manager import AdapterManager
    from loraplex.lora.preloader import AdapterPreloader
    from loraplex.lora.shapes import module_shapes
    from loraplex.lora.slots import LoraSlots
    from loraplex.models.loader import load_hf_config

    cfg = load_hf_config(args.model_dir)
    shapes = module_shapes(cfg)
    weights = {k: v.float() for k, v in load_file(str(Path(args.model_dir) / "model.safetensors")).items()}
    slots = LoraSlots(cfg.num_hidden_layers, shapes, 1, 16, torch.float32, "cpu")
    slots.base_weight = lambda layer, module: (
        weights[f"model.layers.{layer}.{MODULES[module]}.{module}.weight"], None)
    manager = AdapterManager(slots, cfg, max_lora_rank=16, max_cpu_loras=4)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        mallory = [write_adapter(root / f"dora{i}", cfg, shapes, list(MODULES), 16, True, i)
                   for i in range(args.versions)]
        alice = write_adapter(root / "plain", cfg, shapes, ["q_proj", "v_proj"], 8, False, 99)
        start = time.perf_counter()
        manager.read("mallory/dora@0", mallory[0])
        dora_read = time.perf_counter() - start
        rows = []
        for label, cls in (("4fbff58 (FIFO)", old_preloader()), ("060 (fair queuing)", AdapterPreloader)):
            alone = alice_latency(cls, manager, [], alice)
            behind = alice_latency(cls, manager, mallory, alice)
            rows.append((label, alone, behind))
    print(f"model {Path(args.model_dir).name}: {cfg.num_hidden_layers} layers; one DoRA read (rank 16, all 7 "
          f"projections) {dora_read * 1e3:.0f} ms; mallory queues {args.versions}; torch threads {args.threads}")
    print(f"{'preloader':<22} {'alice alone':>12} {'behind mallory':>15} {'ratio':>7}")
    for label, alone, behind in rows:
        print(f"{label:<22} {alone * 1e3:>9.0f} ms {behind * 1e3:>12.0f} ms {behind / alone:>7.1f}")


if __name__ == "__main__":
    main()
