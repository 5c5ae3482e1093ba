"""headroom.contract: what the engine, the sidecar and the operator agree on.

The budget model (one architecture record, one KV-bytes formula), the `/stats` schema (engine ->
sidecar), the `/saturation` report (sidecar -> operator), ports, metric names, the forecast
functions both the sidecar and the scaling decision use, and the umbrella `headroom` CLI. The
three parts import this package and never each other (tests/test_contract.py enforces it).
"""
