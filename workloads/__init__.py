"""Workload grammar, token streams and synthetic GGUF models."""
