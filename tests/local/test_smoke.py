"""The example commands `up` prints must work when pasted into a shell."""

from __future__ import annotations

import shlex

from splitserve.local.smoke import example_commands


def test_example_commands_parse_as_shell_and_carry_the_model() -> None:
    curl, python = example_commands("http://127.0.0.1:8000/v1", "tiny-llama")
    curl_words = shlex.split(curl)
    assert curl_words[:3] == ["curl", "-s", "http://127.0.0.1:8000/v1/completions"]
    assert '"model": "tiny-llama"' in curl_words[-1]
    python_words = shlex.split(python)
    assert python_words[:4] == ["OPENAI_BASE_URL=http://127.0.0.1:8000/v1", "OPENAI_API_KEY=unused", "python", "-c"]
    compile(python_words[4], "<example>", "exec")  # valid Python once the shell removed its quotes
    assert 'model="tiny-llama"' in python_words[4]
    assert "'\"'\"'" not in python, "no nested-quote escapes in what people copy"
