"""headroom.sidecar: the per-pod exporter of KV-cache state and saturation forecast."""
