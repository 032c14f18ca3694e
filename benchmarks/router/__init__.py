"""Benchmarks: router (scripts run as `python benchmarks/router/<script>.py`)."""
