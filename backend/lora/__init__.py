"""LoRA adapters: loading and validation (adapter), device slots (slots), on-demand residency (manager)."""

from .adapter import AdapterError, LoraAdapter, load_peft_adapter  # noqa: F401
from .manager import AdapterManager, AdapterNotFound  # noqa: F401
from .shapes import MODULES, module_shapes, normalize_target  # noqa: F401
from .slots import LoraSlots  # noqa: F401
