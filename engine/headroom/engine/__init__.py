"""headroom.engine: the paged-KV inference engine and the KV budget model."""
