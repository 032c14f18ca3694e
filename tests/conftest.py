"""Settings for the whole test suite."""

from __future__ import annotations

from hypothesis import settings

# Property tests check logic, not speed: a per-example deadline fails them on a machine busy with
# other work (CI's 2 cores run vLLM next to them), which is a flake, not a finding.
settings.register_profile("splitserve", deadline=None)
settings.load_profile("splitserve")
