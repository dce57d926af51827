"""LoRA adapters: loading and validation (adapter), device slots (slots), on-demand residency (manager)."""

from loraplex.lora.adapter import LoraAdapter, load_peft_adapter  # noqa: F401
from loraplex.lora.manager import AdapterManager  # noqa: F401
from loraplex.lora.shapes import MODULES, module_shapes, normalize_target  # noqa: F401
from loraplex.lora.slots import LoraSlots  # noqa: F401
