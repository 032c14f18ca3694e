"""What a quantile read with `histogram_quantile` can say against a limit (an SLO). Pure.

`histogram_quantile` finds the bucket that holds the quantile's rank and interpolates linearly inside it,
so the true quantile lies somewhere in that bucket, wherever the interpolated value falls. Against a
limit strictly inside that bucket the histogram cannot tell over from within: a p90 of 2.05 s in the
1.0-2.5 s bucket may be 1.1 s or 2.4 s, and says nothing certain about a 2 s SLO. A limit on a bucket
bound is judged exactly (the histogram counts the observations up to each bound).

The bounds are the histogram's `le` labels as Prometheus has them (telemetry.collect reads them), never
a list known in advance: the router's buckets and vLLM's engine buckets differ, and both may change.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

Side = Literal["over", "within", "unsure"]
Unit = Literal["s", "ms"]

CANNOT_TELL = "the histogram cannot tell"


@dataclass(frozen=True)
class Judged:
    """A quantile against a limit: the side it is certainly on, or "unsure"; and the bucket it lies in,
    (lower, upper] (0 and inf when the bounds are not known: then the value is taken as exact)."""

    side: Side
    value: float
    limit: float
    lower: float = 0.0
    upper: float = math.inf

    @property
    def unsure(self) -> bool:
        return self.side == "unsure"

    @property
    def over(self) -> bool:
        return self.side == "over"


def bucket_of(value: float, bounds: Sequence[float]) -> tuple[float, float] | None:
    """The bucket (lower, upper] a `histogram_quantile` value lies in; None without finite bounds.

    A value on a bound is the top of the bucket below it (`histogram_quantile` returns the upper bound when
    the rank is exactly that bucket's count). The highest finite bound is also what it returns for a rank in
    the +Inf bucket, so there the bucket runs from the bound below it to +Inf.
    """
    finite = sorted(bound for bound in bounds if math.isfinite(bound))
    if not finite:
        return None
    if value >= finite[-1]:
        return (finite[-2] if len(finite) > 1 else 0.0), math.inf
    index = next(i for i, bound in enumerate(finite) if value <= bound)
    return (finite[index - 1] if index else 0.0), finite[index]


def judge(value: float, limit: float, bounds: Sequence[float] = ()) -> Judged:
    """`value` (a quantile) against `limit`: "over" or "within" only when its whole bucket is on that side."""
    bucket = bucket_of(value, bounds)
    if bucket is None:
        return Judged("over" if value > limit else "within", value, limit)
    lower, upper = bucket
    if lower >= limit:
        side: Side = "over"
    elif upper <= limit:
        side = "within"
    else:
        side = "unsure"
    return Judged(side, value, limit, lower, upper)


def bound_text(bound: float, unit: Unit) -> str:
    """A bucket bound as people read it: 1.0 s, 2.25 s, 50 ms, 17.5 ms."""
    if unit == "ms":
        return f"{round(bound * 1000, 6):g}"
    text = f"{round(bound, 6):g}"
    return text if any(c in text for c in ".e") else text + ".0"


def bucket_text(judged: Judged, unit: Unit) -> str:
    """ "1.0-2.5 s", "50-75 ms" (with an en dash), "above 640.0 s"."""
    if math.isinf(judged.upper):
        return f"above {bound_text(judged.lower, unit)} {unit}"
    return f"{bound_text(judged.lower, unit)}-{bound_text(judged.upper, unit)} {unit}"


def within_one_bucket(quantile: str, limit: str, judged: Judged, unit: Unit) -> str:
    """'TTFT p90 ≈ 2.05 s at the router is within one histogram bucket of the 2 s SLO (the bucket is 1.0-2.5 s)'.

    `quantile` names the quantile with its value ("TTFT p90 ≈ 2.05 s at the router"), `limit` the limit.
    """
    return f"{quantile} is within one histogram bucket of {limit} (the bucket is {bucket_text(judged, unit)})"
