"""Benchmarks: scripts run as `python benchmarks/<area>/<script>.py` (those that import the harness put
the repository root on sys.path themselves).

A package only so import-linter can check that benchmarks never import `tests`: they use `testkit`.
"""
