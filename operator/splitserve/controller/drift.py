"""Pure drift check: does the observed object already carry everything we would apply?

Applying only when something differs keeps the operator quiet: no write, no watch event, no
reconcile triggered by our own no-op writes (an emulator or an older API server may bump
resourceVersion even for a no-op apply).
"""

from __future__ import annotations

from typing import Any


def _same_scalar(desired: Any, observed: Any) -> bool:
    if desired == observed:
        return True
    # Quantities and int-or-string ports round-trip as either form ("4" vs 4).
    return isinstance(desired, str | int) and isinstance(observed, str | int) and str(desired) == str(observed)


def contains(observed: Any, desired: Any) -> bool:
    """True when every field set in `desired` has the same value in `observed`.

    Fields only in `observed` (server defaults, other managers' fields, status) are ignored;
    lists must match element by element because we own the whole list.
    """
    if isinstance(desired, dict):
        return isinstance(observed, dict) and all(
            key in observed and contains(observed[key], value) for key, value in desired.items()
        )
    if isinstance(desired, list):
        return (
            isinstance(observed, list)
            and len(observed) == len(desired)
            and all(contains(o, d) for o, d in zip(observed, desired, strict=True))
        )
    return _same_scalar(desired, observed)
