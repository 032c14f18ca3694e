from testkit.emulator.fixtures import (  # noqa: F401  (fixtures are found by name)
    async_emulator_client,
    emulator,
    emulator_client,
    emulator_factory,
    fresh_namespace,
    kubectl,
    namespaced_kubectl,
    shared_client,
    shared_emulator,
)
