"""Memory plans, roofline bounds and depth recommendations (read GGUF headers and result files only)."""
