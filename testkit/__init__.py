"""The harness shared by tests and benchmarks: the Kubernetes API emulator (`testkit.emulator`), the
Prometheus server fixture (`testkit.prometheus`), the operator process (`testkit.operator`), the router
and simulated-worker helpers (`testkit.router`) and the rigs that play kubelet (`testkit.rigs`).

Not shipped in the wheel. It never imports `tests` (an import-linter contract), so benchmarks can use it
without pulling in test modules.
"""
