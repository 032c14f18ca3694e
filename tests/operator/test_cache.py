"""ClusterCache: the watch-fed indexes, shadowed by the operator's own writes until the watch catches up."""

from __future__ import annotations

from typing import Any

from splitserve.controller.cache import WRITE_SHADOW_SECONDS, ClusterCache

NS = "serving"


def service(name: str, version: int, owner: str = "demo", port: int = 80) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {
            "name": name,
            "namespace": NS,
            "resourceVersion": str(version),
            "labels": {"splitserve.io/deployment": owner},
        },
        "spec": {"ports": [{"port": port}]},
    }


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def cache_with(*children: dict[str, Any]) -> tuple[ClusterCache, Clock]:
    clock = Clock()
    cache = ClusterCache(clock=clock)
    index: dict[Any, list[dict[str, Any]]] = {}
    for child in children:
        index.setdefault((NS, child["metadata"]["labels"]["splitserve.io/deployment"]), []).append(child)
    cache.bind({}, index)
    return cache, clock


def port_of(cache: ClusterCache, name: str) -> int | None:
    found = cache.child(NS, "demo", "v1", "Service", name)
    return None if found is None else int(found["spec"]["ports"][0]["port"])


def test_a_write_is_seen_before_the_watch_delivers_it() -> None:
    cache, _ = cache_with(service("a", 10))
    cache.wrote(service("a", 11, port=81))
    cache.wrote(service("b", 12))  # a new child, not in the index yet
    assert port_of(cache, "a") == 81
    assert set(cache.owned(NS, "demo")) == {("v1", "Service", "a"), ("v1", "Service", "b")}


def test_the_watch_wins_once_it_is_as_new_as_the_write() -> None:
    index_entry = service("a", 10)
    cache, _ = cache_with(index_entry)
    cache.wrote(service("a", 11, port=81))
    # kopf's index now shows a later version (another writer changed it after us).
    cache.bind({}, {(NS, "demo"): [service("a", 12, port=90)]})
    assert port_of(cache, "a") == 90
    # ...and the shadow is gone for good: an older index entry does not bring the write back.
    cache.bind({}, {(NS, "demo"): [index_entry]})
    assert port_of(cache, "a") == 80


def test_an_older_watch_event_does_not_undo_a_newer_write() -> None:
    cache, _ = cache_with(service("a", 10))
    cache.wrote(service("a", 11, port=81))
    cache.bind({}, {(NS, "demo"): [service("a", 10)]})
    assert port_of(cache, "a") == 81


def test_a_deletion_hides_the_child_until_the_watch_drops_it() -> None:
    cache, _ = cache_with(service("a", 10))
    cache.deleted("v1", "Service", NS, "a")
    assert port_of(cache, "a") is None
    cache.bind({}, {})
    assert port_of(cache, "a") is None
    cache.wrote(service("a", 20))  # recreated
    assert port_of(cache, "a") == 80


def test_a_write_the_watch_never_confirms_stops_shadowing_after_a_while() -> None:
    cache, clock = cache_with(service("a", 10))
    cache.wrote(service("a", 11, port=81))
    clock.now = WRITE_SHADOW_SECONDS + 1
    assert port_of(cache, "a") == 80


def test_children_of_other_owners_and_namespaces_stay_apart() -> None:
    cache, _ = cache_with(service("a", 10))
    cache.wrote(service("x", 11, owner="other"))
    elsewhere = service("y", 12)
    elsewhere["metadata"]["namespace"] = "elsewhere"
    cache.wrote(elsewhere)
    assert set(cache.owned(NS, "demo")) == {("v1", "Service", "a")}
    assert set(cache.owned(NS, "other")) == {("v1", "Service", "x")}


def test_a_watched_deletion_ends_the_shadow_of_a_write() -> None:
    cache, _ = cache_with()
    written = service("a", 11)
    cache.wrote(written)
    cache.gone(written)
    assert port_of(cache, "a") is None


def test_the_deployment_is_read_from_its_index_and_its_status_from_the_last_write() -> None:
    body = {
        "apiVersion": "splitserve.io/v1alpha1",
        "kind": "InferenceDeployment",
        "metadata": {"name": "demo", "namespace": NS, "resourceVersion": "5"},
        "spec": {},
    }
    cache = ClusterCache()
    cache.bind({(NS, "demo"): [body]}, {})
    assert cache.deployment(NS, "demo") == body
    cache.wrote({**body, "metadata": {**body["metadata"], "resourceVersion": "6"}, "status": {"ready": "True"}})
    found = cache.deployment(NS, "demo")
    assert found is not None and found["status"] == {"ready": "True"}
    assert cache.deployment(NS, "missing") is None
