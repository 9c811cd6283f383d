"""moebench: benchmark MoE expert offload (--n-cpu-moe) across engines."""
__version__ = "0.1.0"
