"""`up --verbose`: one summary line per request, read from the router's log as it is written.

The router writes one record per finished request, as JSON after its log prefix (logger
``splitserve.router.requests``):
  INFO splitserve.router.requests: {"event": "request", "request_id": "...", "mode": "disaggregated", ...}
The logfmt form (``request_id=abc mode=disaggregated status=200 ...``) is read too.
A line that carries no request_id is not a request record and is skipped.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_LOGFMT_PAIR = re.compile(r'(\w+)=("(?:[^"\\]|\\.)*"|\S+)')

# Names the router may use for each field, first match wins.
_FIELDS: dict[str, tuple[str, ...]] = {
    "request_id": ("request_id", "id", "x_request_id"),
    "mode": ("mode",),
    "status": ("status", "status_code", "http_status"),
    "outcome": ("outcome", "result"),
    "path": ("path", "endpoint"),
    "prefill": ("prefill", "prefill_worker", "prefill_url"),
    "decode": ("decode", "decode_worker", "decode_url"),
    "prompt_tokens": ("prompt_tokens", "input_tokens"),
    "completion_tokens": ("completion_tokens", "output_tokens", "tokens"),
    "seconds": ("duration_s", "seconds", "latency_s", "elapsed_s", "duration"),
    "ttft": ("ttft_s", "ttft", "time_to_first_token_s"),
    "reason": ("fallback_reason", "reason"),
}


@dataclass(frozen=True)
class RequestRecord:
    fields: Mapping[str, str]

    def get(self, key: str) -> str | None:
        return self.fields.get(key)


def _raw_fields(line: str) -> dict[str, Any]:
    start = line.find("{")
    if start != -1:
        try:
            parsed = json.loads(line[start:])
        except ValueError:
            parsed = None
        if isinstance(parsed, dict):
            return parsed
    return {key: value.strip('"') for key, value in _LOGFMT_PAIR.findall(line)}


def parse_request_line(line: str) -> RequestRecord | None:
    raw = _raw_fields(line)
    fields: dict[str, str] = {}
    for name, aliases in _FIELDS.items():
        for alias in aliases:
            value = raw.get(alias)
            if value is not None and value != "":
                fields[name] = str(value)
                break
    if "request_id" not in fields:
        return None
    return RequestRecord(fields)


def _seconds(value: str | None) -> str | None:
    if value is None:
        return None
    try:
        return f"{float(value):.3f}s"
    except ValueError:
        return value


def summarize(record: RequestRecord, names_by_url: Mapping[str, str]) -> str:
    """One readable line: id, path, route (prefill -> decode by process name), status, tokens, timing."""

    def worker(key: str) -> str | None:
        value = record.get(key)
        if value is None:
            return None
        return names_by_url.get(value.rstrip("/"), value)

    parts = [f"request {record.get('request_id')}"]
    if record.get("path"):
        parts.append(str(record.get("path")))
    route = " -> ".join(name for name in (worker("prefill"), worker("decode")) if name)
    mode = record.get("mode")
    if mode or route:
        parts.append(" ".join(part for part in (mode, route and f"({route})") if part))
    if record.get("reason") and mode == "fallback":
        parts.append(f"reason={record.get('reason')}")
    status = " ".join(value for value in (record.get("status"), record.get("outcome")) if value)
    if status:
        parts.append(status)
    tokens = [
        f"{record.get(key)} {label}"
        for key, label in (("prompt_tokens", "prompt"), ("completion_tokens", "completion"))
        if record.get(key)
    ]
    if tokens:
        parts.append(" + ".join(tokens) + " tokens")
    timing = [
        f"{label} {value}"
        for label, value in (("ttft", _seconds(record.get("ttft"))), ("total", _seconds(record.get("seconds"))))
        if value
    ]
    if timing:
        parts.append(", ".join(timing))
    return " | ".join(parts)


class RequestLogFollower:
    """Tails a log file in a background thread and reports each request record as a summary."""

    def __init__(self, path: Path, names_by_url: Mapping[str, str], report: Callable[[str], None]) -> None:
        self._path = path
        self._names_by_url = dict(names_by_url)
        self._report = report
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._follow, name="request-log", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def add_names(self, names_by_url: Mapping[str, str]) -> None:
        """Name workers started later (a rollout's, added replicas); a new dict, so the reader never
        sees one half-updated."""
        self._names_by_url = {**self._names_by_url, **names_by_url}

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2.0)

    def _follow(self) -> None:
        try:
            log = self._path.open("r", encoding="utf-8", errors="replace")
        except OSError:
            return
        with log:
            log.seek(0, 2)  # only requests from now on: start-up lines are not requests
            pending = ""
            while not self._stop.is_set():
                chunk = log.readline()
                if not chunk:
                    time.sleep(0.1)
                    continue
                pending += chunk
                if not pending.endswith("\n"):
                    continue  # a line still being written
                record = parse_request_line(pending)
                pending = ""
                if record is not None:
                    self._report(summarize(record, self._names_by_url))
