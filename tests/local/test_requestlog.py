"""`up --verbose`: router request records to one-line summaries."""

from __future__ import annotations

import json
import time
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from splitserve.local.requestlog import RequestLogFollower, parse_request_line, summarize

NAMES = {"http://127.0.0.1:9001": "prefill-0", "http://127.0.0.1:9002": "decode-0"}
LOGFMT = (
    "2026-12-02 11:36:50,796 INFO splitserve.router.access: request_id=abc path=/v1/completions "
    "mode=disaggregated status=200 outcome=success prefill=http://127.0.0.1:9001 decode=http://127.0.0.1:9002/ "
    "prompt_tokens=12 completion_tokens=16 ttft_s=0.0412 duration_s=0.3051"
)


def test_logfmt_record_summary_names_the_processes() -> None:
    record = parse_request_line(LOGFMT)
    assert record is not None
    assert summarize(record, NAMES) == (
        "request abc | /v1/completions | disaggregated (prefill-0 -> decode-0) | 200 success "
        "| 12 prompt + 16 completion tokens | ttft 0.041s, total 0.305s"
    )


def test_json_record_with_a_fallback_reason() -> None:
    line = "INFO access " + json.dumps(
        {"request_id": "r1", "mode": "fallback", "fallback_reason": "prefill_failed", "status": 200,
         "decode": "http://127.0.0.1:9002", "duration_s": 1.5}
    )  # fmt: skip
    record = parse_request_line(line)
    assert record is not None
    summary = summarize(record, NAMES)
    assert "fallback (decode-0)" in summary and "reason=prefill_failed" in summary and "total 1.500s" in summary


def test_lines_that_are_not_requests_are_skipped() -> None:
    assert parse_request_line("INFO splitserve.router.pool: decode worker added: http://127.0.0.1:1") is None
    assert parse_request_line("") is None


@given(st.text())
def test_parser_never_raises(line: str) -> None:
    record = parse_request_line(line)
    if record is not None:
        assert summarize(record, NAMES).startswith("request ")


def test_follower_reports_records_appended_after_it_starts(tmp_path: Path) -> None:
    log = tmp_path / "router.log"
    log.write_text("request_id=old status=200\n")
    seen: list[str] = []
    follower = RequestLogFollower(log, NAMES, seen.append)
    follower.start()
    try:
        time.sleep(0.3)
        with log.open("a") as out:
            out.write("INFO unrelated line\n")
            out.write(LOGFMT[:40])
            out.flush()
            time.sleep(0.3)
            out.write(LOGFMT[40:] + "\n")
        deadline = time.monotonic() + 5
        while not seen and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        follower.stop()
    assert len(seen) == 1 and seen[0].startswith("request abc |")
