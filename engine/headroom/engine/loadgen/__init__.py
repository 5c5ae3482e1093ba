"""`headroom load`: a load generator for OpenAI-compatible servers (this engine or vLLM)."""
