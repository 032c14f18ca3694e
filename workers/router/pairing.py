"""Which KV generations may serve a request: pure decisions, no I/O (the flow asks, the pools filter).

During a rollout two generations of workers (model revision + engine image, the
``splitserve.io/generation`` label) run side by side. KV computed by a prefill worker of one
generation must never be decoded by a worker of another: the transfer may well succeed and decode
would continue from KV of other weights, an HTTP 200 with fluent garbage. So the decode worker is
chosen first and its generation fixes the prefill worker's; "" (unknown) pairs only with "".
"""

from __future__ import annotations

from splitserve.router.config import GenerationPairing

# The generations a request may be served by; None: any.
Generations = frozenset[str] | None


def decode_generations(prefill_healthy: frozenset[str], decode_healthy: frozenset[str]) -> Generations:
    """The decode generations a request that will be disaggregated may take.

    When at least one generation has both a healthy prefill and a healthy decode worker, only those
    complete generations: a generation whose prefill workers are not up yet (or already gone) gets
    no disaggregated traffic, so as a new generation's pairs become ready the traffic moves onto
    them in proportion to decode capacity. With no complete generation nothing is gained by a limit
    (the request falls back to aggregated wherever it goes): None. None as well when every healthy
    decode generation is complete, which is the usual single-generation case (no filtering at all).
    """
    complete = prefill_healthy & decode_healthy
    if not complete or decode_healthy <= complete:
        return None
    return complete


def prefill_generations(decode_generation: str, pairing: GenerationPairing) -> Generations:
    """The prefill generations a request decoded by a worker of ``decode_generation`` may use."""
    if pairing is GenerationPairing.OFF:
        return None
    return frozenset((decode_generation,))
