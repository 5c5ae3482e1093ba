"""The metric contract's names (shared/DESIGN.md): the sidecar exports them, the operator's
Prometheus source and the shipped alert rules query them."""

from __future__ import annotations

ENGINE_UP = "headroom_engine_up"
KV_BLOCKS = "headroom_kv_blocks"  # label state = free / used / cached
KV_BLOCKS_CAPACITY = "headroom_kv_blocks_capacity"
KV_BLOCKS_PLANNED = "headroom_kv_blocks_planned"  # only with the sidecar's --planned-blocks
KV_OCCUPANCY = "headroom_kv_block_occupancy_ratio"
KV_BYTES_PER_TOKEN = "headroom_kv_bytes_per_token"
PREFIX_QUERIES = "headroom_prefix_cache_queries_tokens_total"
PREFIX_HITS = "headroom_prefix_cache_hits_tokens_total"
PREFIX_HIT_RATIO = "headroom_prefix_cache_hit_ratio"
PREFIX_ENABLED = "headroom_prefix_cache_enabled"
REQUESTS = "headroom_requests"  # label state = running / waiting / swapped
PREEMPTIONS = "headroom_preemptions_total"
SATURATION_ETA = "headroom_kv_saturation_eta_seconds"
REQUESTS_ARRIVED = "headroom_requests_arrived_total"
PROMPT_TOKENS_ARRIVED = "headroom_prompt_tokens_arrived_total"
REQUESTS_DEPARTED = "headroom_requests_departed_total"
KV_BLOCK_SECONDS = "headroom_kv_block_seconds_total"
KV_DEMAND = "headroom_kv_demand_blocks"
TTFT = "headroom_time_to_first_token_seconds"
TPOT = "headroom_time_per_output_token_seconds"
SIDECAR_POLL_ERRORS = "headroom_sidecar_poll_errors_total"
SIDECAR_ENGINE_RESTARTS = "headroom_sidecar_engine_restarts_total"

# The operator's own /metrics.
DESIRED_REPLICAS = "headroom_desired_replicas"
CURRENT_REPLICAS = "headroom_current_replicas"
SCALING_DECISIONS = "headroom_scaling_decisions_total"
RECONCILES = "headroom_reconciles_total"
SCALING_LAST_TICK = "headroom_scaling_last_tick_timestamp_seconds"
SCALING_INTERVAL = "headroom_scaling_interval_seconds"
SCALING_TICK_FAILURES = "headroom_scaling_tick_failures_total"
