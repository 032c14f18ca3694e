"""Benchmarks: operator (scripts run as `python benchmarks/operator/<script>.py`)."""
