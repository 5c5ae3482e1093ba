# End-to-end scenarios on the real control plane (e2e/): included by the top-level Makefile.
#   make e2e             build (first run) and start the control plane, install the chart, run
#                        every scenario (e2e/test_*.py), print per-scenario timings and the
#                        slowest steps
#   make e2e E2E_ARGS=-k wall      pass extra pytest arguments (one scenario, -x, ...)
# The build is cached under ~/.cache/headroom, so a warm run takes a few minutes.
E2E_ARGS ?=

.PHONY: e2e
e2e: venv tools
	@start=$$(date +%s); \
	$(PY) -m pytest e2e --durations=15 --durations-min=1 -rsxf $(E2E_ARGS); rc=$$?; \
	echo "make e2e: $$(( $$(date +%s) - start ))s wall clock (rc=$$rc)"; exit $$rc
