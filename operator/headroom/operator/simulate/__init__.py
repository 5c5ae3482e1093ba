"""Trace replay: read real traffic, profile it, and run it through the operator's own
`decide()` on a simulated deployment of engines (`headroom profile`, `headroom simulate`)."""
