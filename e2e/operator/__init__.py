"""End-to-end tests of the operator: the Helm chart, the CRDs and `eaas operator` on a real control plane."""
