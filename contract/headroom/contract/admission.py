"""The engine's admission rule, pure and torch-free: the engine's scheduler admits by it, and
the autoscaling simulator imports it, so what it simulates is what the engine does."""

from __future__ import annotations

# The fraction of blocks kept free at admission for running decodes: the engine's default, and
# what the simulator assumes of a pod. 5 %, not vLLM's old 1 %: at 0.01 bench/kv_waste.py
# recomputed 18.7 % of tokens under preemption.
DEFAULT_WATERMARK = 0.05


def watermark_blocks(watermark: float, num_blocks: int) -> int:
    """Blocks a pool of `num_blocks` keeps free at admission for the decodes already running."""
    if not 0 <= watermark < 1:
        raise ValueError(f"watermark must be in [0, 1), got {watermark}")
    return int(watermark * num_blocks)


def fits(
    free_blocks: int, prompt_blocks: int, watermark_blocks: int, running: int, max_num_seqs: int
) -> bool:
    """Whether a waiting request is admitted now: a free slot among `max_num_seqs`, and the
    blocks its prompt (this step's chunk) takes out of `free_blocks` (free plus evictable),
    leaving the watermark free while anything runs."""
    if running >= max_num_seqs:
        return False
    # With nothing running the watermark would only hold back a request that fits the empty pool.
    reserve = watermark_blocks if running else 0
    return prompt_blocks + reserve <= free_blocks
