"""Benchmarks: diagnosis (scripts run as `python benchmarks/diagnosis/<script>.py`)."""
