"""The request path's lock-free counters and histograms: a scrape reads exactly what prometheus-client's
own Counter and Histogram would report, in one process and summed over a ``--workers N`` router's."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest, multiprocess
from prometheus_client.parser import text_string_to_metric_families

from splitserve.router.fast_metrics import FastCollector, FastCounter, FastHistogram
from splitserve.router.metrics import LATENCY_BUCKETS

LABELLED = ("pool",)


def samples(text: bytes) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample but the _created ones (prometheus-client's own; the fast metrics have none)."""
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text.decode())
        for s in family.samples
        if not s.name.endswith("_created")
    }


values = st.lists(
    st.one_of(st.floats(min_value=0, max_value=1000, allow_nan=False), st.sampled_from(LATENCY_BUCKETS)),
    max_size=60,
)


@settings(max_examples=60, deadline=None)
@given(values, st.lists(st.sampled_from(["prefill", "decode"]), min_size=60, max_size=60))
def test_a_scrape_reads_what_prometheus_client_would(observed: list[float], pools: list[str]) -> None:
    # Values on a bound land in that bound's bucket (le is inclusive), as in prometheus-client.
    fast_registry, reference = CollectorRegistry(), CollectorRegistry()
    fast = FastHistogram("lat_seconds", "h", LABELLED, buckets=LATENCY_BUCKETS)
    plain = FastHistogram("plain_seconds", "h", buckets=LATENCY_BUCKETS)
    count = FastCounter("events", "c", LABELLED)
    fast_registry.register(FastCollector([fast, plain, count]))
    ref = Histogram("lat_seconds", "h", LABELLED, buckets=LATENCY_BUCKETS, registry=reference)
    ref_plain = Histogram("plain_seconds", "h", buckets=LATENCY_BUCKETS, registry=reference)
    ref_count = Counter("events", "c", LABELLED, registry=reference)
    for value, pool in zip(observed, pools, strict=False):
        fast.labels(pool).observe(value)
        ref.labels(pool).observe(value)
        plain.observe(value)
        ref_plain.observe(value)
        count.labels(pool).inc(2)
        ref_count.labels(pool).inc(2)
    assert samples(generate_latest(fast_registry)) == samples(generate_latest(reference))


def test_flushes_into_the_multiprocess_files_add_up_exactly(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What a --workers N process flushes, several times over, is what it counted: never twice, never lost."""
    import prometheus_client.values as values_module

    # The reference counts in memory: its children are made before the multiprocess values are switched on.
    reference = CollectorRegistry()
    ref = Histogram("lat_seconds", "h", LABELLED, buckets=LATENCY_BUCKETS, registry=reference).labels("decode")
    ref_count = Counter("events", "c", LABELLED, registry=reference).labels("decode")
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    monkeypatch.setattr(values_module, "ValueClass", values_module.MultiProcessValue())
    registry = CollectorRegistry()
    fast = FastHistogram("lat_seconds", "h", LABELLED, buckets=LATENCY_BUCKETS)
    count = FastCounter("events", "c", LABELLED)
    histogram_mirror, counter_mirror = fast.mirror(registry), count.mirror(registry)
    observed = [0.0004, 0.02, 0.02, 3.0, 700.0, 0.3, 0.0]
    for round_ in range(3):
        for value in observed[round_:]:
            fast.labels("decode").observe(value)
            ref.observe(value)
            count.labels("decode").inc()
            ref_count.inc()
        for _ in range(2):  # the second flush has nothing new: it must add nothing
            fast.flush_into(histogram_mirror)
            count.flush_into(counter_mirror)
    merged = CollectorRegistry()
    multiprocess.MultiProcessCollector(merged, path=str(tmp_path))  # type: ignore[no-untyped-call]
    assert samples(generate_latest(merged)) == samples(generate_latest(reference))
