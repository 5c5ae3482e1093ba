"""`headroom kv-check`: validate fp8/int8 KV on a model and prompts of one's own before
turning it on (top-1 agreement, KL, greedy match length and a needle score per context)."""
