"""This host: its fingerprint (CPU, RAM, GPUs, versions) and the measured hardware profile (probe)."""
