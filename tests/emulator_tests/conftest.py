from tests.emulator.fixtures import (  # noqa: F401  (fixtures are found by name)
    emulator,
    emulator_client,
    kubectl,
    namespaced_kubectl,
    shared_client,
    shared_emulator,
    test_namespace,
)
