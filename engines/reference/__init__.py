"""The built-in PyTorch MoE offload engine."""
