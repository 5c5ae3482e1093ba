"""The OpenAI-compatible HTTP server of the engine (`headroom serve`)."""
