"""The settings of an engine's waits (waits.py), as the builders put them in its environment.

Pure: the operator's builders render them into worker pods, the engine reads them back at start.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

ENV_MODE = "SPLITSERVE_ENGINE_WAITS"
ENV_SPIN_US = "SPLITSERVE_WAIT_SPIN_US"
ENV_NIXL_POLL_US = "SPLITSERVE_NIXL_POLL_US"

WaitMode = Literal["spin", "events"]
DEFAULT_SPIN_US = 0
DEFAULT_NIXL_POLL_US = 1000


@dataclass(frozen=True)
class WaitSettings:
    mode: WaitMode = "spin"
    spin_us: int = DEFAULT_SPIN_US
    nixl_poll_us: int = DEFAULT_NIXL_POLL_US

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> WaitSettings:
        """The settings an engine's environment carries; anything unset or unreadable is vLLM's default."""
        mode = environ.get(ENV_MODE, "spin").strip().lower()
        if mode != "events":
            return cls()
        return cls(
            "events", _int(environ, ENV_SPIN_US, DEFAULT_SPIN_US), _int(environ, ENV_NIXL_POLL_US, DEFAULT_NIXL_POLL_US)
        )

    def to_env(self) -> dict[str, str]:
        if self.mode == "spin":
            return {ENV_MODE: "spin"}
        return {ENV_MODE: "events", ENV_SPIN_US: str(self.spin_us), ENV_NIXL_POLL_US: str(self.nixl_poll_us)}

    def describe(self) -> str:
        if self.mode == "spin":
            return "spin (vLLM's own waits)"
        return f"events (NIXL progress poll {self.nixl_poll_us} µs, reader spin {self.spin_us} µs)"


def _int(environ: Mapping[str, str], name: str, default: int) -> int:
    try:
        return max(0, int(environ[name]))
    except (KeyError, ValueError):
        return default


EVENTS_ON_CPU = WaitSettings("events")
