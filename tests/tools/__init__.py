"""Tests that run GuideLLM, lm-evaluation-harness and AIPerf against eaas serve (a package, so
that the served fixture ends with these tests)."""
