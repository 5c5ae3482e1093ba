# Test control plane (e2e/cluster): included by the top-level Makefile.
#   make cluster-build   build kube-apiserver, kube-controller-manager, kube-scheduler, kubectl,
#                        kwok and helm into ~/.cache/headroom/bin/<versions> (reused when present)
#   make cluster-up      start etcd + control plane + kwok GPU nodes; prints the env file
#   make cluster-down    stop exactly the processes cluster-up started and remove its state
# CLUSTER=<name> picks the cluster (default "default"); see e2e/cluster/up.sh for the env knobs.
CLUSTER ?= default

.PHONY: cluster-build cluster-up cluster-down
cluster-build:
	@e2e/cluster/build.sh >/dev/null

cluster-up: tools
	@env=$$(e2e/cluster/up.sh $(CLUSTER)) && echo "cluster $(CLUSTER) is up; use it with:" && \
	  echo "  source $$env && export KUBECONFIG  # then: $$(sed -n 's/^HEADROOM_CLUSTER_BIN=//p' $$env)/kubectl get nodes"

cluster-down:
	@e2e/cluster/down.sh $(CLUSTER)
