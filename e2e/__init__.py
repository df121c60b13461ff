"""End-to-end tests against a real Kubernetes control plane (see docs/kubernetes-test-cluster.md)."""
