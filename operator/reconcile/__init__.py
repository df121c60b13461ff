"""Reconcilers: observe (API reads) → decide (pure builders/planners) → act (API writes) → status.

Each is level-based and idempotent: it computes the whole desired state on every call, so a
missed event, a retry or an operator restart converges to the same objects.
"""
