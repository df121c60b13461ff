# Placeholder until the control-plane issue lands: builds nothing yet.
.PHONY: k8s-bins
k8s-bins:
	@true
