"""A Kubernetes API emulator (built on kmock) for integration tests and benchmarks; see README.md in this folder."""
