"""Kubernetes operator for DDTree speculative-decoding engines (`SpeculativeDeployment`, ddtree.dev/v1alpha1)."""
