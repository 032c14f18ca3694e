"""Stands in for `python -m splitserve` in tests: only `tiny-model DIR [--loras-only] [--lora=NAME ...]`,
which it fakes quickly.

Each call appends a line to $FAKE_SPLITSERVE_CALLS; FAKE_TINY_MODEL_FAIL=1 makes the build fail.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path


def main() -> int:
    with open(os.environ["FAKE_SPLITSERVE_CALLS"], "a") as calls:
        calls.write(" ".join(sys.argv[1:]) + "\n")
    if sys.argv[1:2] != ["tiny-model"]:
        return 2
    if os.environ.get("FAKE_TINY_MODEL_FAIL"):
        Path(sys.argv[2]).mkdir(parents=True)  # half-written, as a real failure would leave it
        print("tiny-model: tokenizer training failed: no more bytes", flush=True)
        return 1
    target = Path(sys.argv[2])
    flags = sys.argv[3:]
    if "--loras-only" not in flags:
        target.mkdir(parents=True)
        (target / "config.json").write_text('{"model_type": "llama"}')
    for name in (flag.removeprefix("--lora=") for flag in flags if flag.startswith("--lora=")):
        (target / "loras" / name).mkdir(parents=True)
        (target / "loras" / name / "adapter_config.json").write_text('{"r": 8}')
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
