"""The rank of a MoE model's expert LoRA stacks (EngineConfig.max_expert_lora_rank, decision 070), and the memory
they take, known before they are allocated.

The stacks hold every slot's pair for every expert and the router at one rank (decision 066), allocated at start:
per unit of rank and slot, ``ExpertLayout.elements_per_rank()`` elements. ``auto`` sizes them to the model: at
``max_lora_rank`` unless all slots' stacks would hold more than 1/AUTO_SHARE of the experts' own weights (and more
than AUTO_FLOOR elements), else at the largest power of two that fits, 0 (no stacks) if none does. The rule reads
the config alone, so every process that validates adapters for one engine config resolves the same rank.
"""

from __future__ import annotations

from loraplex.lora.moe_layout import EXPERT_MODULES, ExpertLayout

AUTO = "auto"
AUTO_SHARE = 8  # auto: all slots' expert stacks hold at most 1/8 of the experts' weights ...
AUTO_FLOOR = 1 << 26  # ... unless they hold at most this many elements (128 MiB in fp16): never lowered below it
KNOB = "max_expert_lora_rank"


def expert_weights(layout: ExpertLayout) -> int:
    """Elements of the experts' own weights (gate, up and down of every expert of every sparse layer)."""
    return len(layout.layers) * layout.num_experts * sum(i * o for i, o in layout.shapes().values())


def resolve_expert_rank(setting, layout: ExpertLayout | None, max_loras: int, max_lora_rank: int) -> int:
    """The expert stacks' rank for max_expert_lora_rank ``setting`` ("auto" or an int): 0 for a dense model."""
    if layout is None:
        return 0
    if setting != AUTO:
        return int(setting)
    budget = max(expert_weights(layout) // AUTO_SHARE, AUTO_FLOOR)
    per_rank = max_loras * layout.elements_per_rank()
    rank = max_lora_rank
    while rank and rank * per_rank > budget:
        rank = 1 << (rank.bit_length() - 1) if rank & (rank - 1) else rank // 2  # a power of two, then halved
    return rank


def expert_stack_bytes(layout: ExpertLayout | None, num_layers: int, max_loras: int, rank: int,
                       element_size: int) -> int:
    """Bytes LoraSlots allocates for the expert stacks at ``rank`` (0 with none): A and B of every slot, expert and
    router at the stacks' dtype, and their int32 ranks and fp32 scales."""
    if layout is None or rank == 0:
        return 0
    weights = max_loras * rank * layout.elements_per_rank() * element_size
    return weights + 8 * max_loras * num_layers * (len(EXPERT_MODULES) * layout.num_experts + 1)
