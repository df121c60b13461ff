# Kubernetes test binaries and a hand-run control plane (included by the root Makefile).
#   make k8s-bins      build etcd, kube-apiserver, kube-controller-manager, kube-scheduler, kubectl, helm
#                      and kwok once into $${EAAS_CACHE_DIR:-~/.cache/eaas}/k8s-<version>/bin (see
#                      docs/kubernetes-test-cluster.md); a no-op when they are cached
#   make host-tools    the host tools the process nodes need (nft for kube-proxy and the pod-network
#                      guard; ip for namespaces), from Debian's packages when missing (needs root)
#   make cluster-up    start the control plane in the background and print the KUBECONFIG to export
#   make cluster-down  stop it and remove its directory
.PHONY: k8s-bins host-tools cluster-up cluster-down cluster-status

k8s-bins: host-tools ## build the Kubernetes test binaries once into ~/.cache/eaas
	@bash e2e/bin/build-k8s.sh

host-tools: ## nft and ip for the process nodes, from Debian's packages when missing (root)
	@command -v nft >/dev/null && command -v ip >/dev/null || { \
		echo "installing nftables and iproute2 (process nodes of the e2e cluster)"; \
		apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q nftables iproute2 >/dev/null \
		|| echo "warning: could not install nftables/iproute2: the whole-system drills will fail"; }

cluster-up: install k8s-bins host-tools ## start a local cluster (2 GPU nodes whose pods run as processes) in the background
	@$(PY) -m e2e.handrun up

cluster-down: ## stop it and remove its directory
	@$(PY) -m e2e.handrun down

cluster-status: ## what of it runs (says so when there is none)
	@$(PY) -m e2e.handrun status
