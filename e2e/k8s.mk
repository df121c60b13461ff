# Kubernetes test binaries and a hand-run control plane (included by the root Makefile).
#   make k8s-bins      build etcd, kube-apiserver, kube-controller-manager, kube-scheduler, kubectl, helm
#                      and kwok once into $${EAAS_CACHE_DIR:-~/.cache/eaas}/k8s-<version>/bin (see
#                      docs/kubernetes-test-cluster.md); a no-op when they are cached
#   make cluster-up    start the control plane in the background and print the KUBECONFIG to export
#   make cluster-down  stop it and remove its directory
.PHONY: k8s-bins cluster-up cluster-down cluster-status

k8s-bins:
	@bash e2e/bin/build-k8s.sh

cluster-up: install k8s-bins
	@$(PY) -m e2e.handrun up

cluster-down:
	@$(PY) -m e2e.handrun down

cluster-status:
	@$(PY) -m e2e.handrun status
