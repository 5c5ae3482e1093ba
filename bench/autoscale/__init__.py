"""The autoscaling benchmark's parts: the baseline policies (HPAs, oracle), the traces it
replays, the frontier and its grading, and the outputs (table, markdown, PNG). The world it
simulates and the headroom policy are the product's own (`headroom.operator.simulate`)."""
