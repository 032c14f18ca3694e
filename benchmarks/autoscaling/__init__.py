"""Benchmarks: autoscaling (scripts run as `python benchmarks/autoscaling/<script>.py`)."""
