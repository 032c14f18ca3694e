"""A Kubernetes API emulator (built on kmock) for integration tests; see README.md in this folder."""
