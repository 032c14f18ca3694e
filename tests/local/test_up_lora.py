"""`splitserve up --engine sim -f deploy/local/tiny-lora.yaml`: the base model and both adapters through the
router, an unknown adapter refused, and a new adapter list taken at run time: no worker restarted, the same
KV generation, no failed request meanwhile."""

from __future__ import annotations

import re
import threading
from pathlib import Path

import openai
import pytest

from splitserve.sim import generate_text, tokenize
from testkit.upctl import ENDPOINT_LINE, REPO, run_up, start_up
from tests.local.serving import pids, serving

pytestmark = pytest.mark.slow

TINY_LORA = REPO / "deploy/local/tiny-lora.yaml"
GENERATION_LINE = re.compile(r"KV generation ([0-9a-f]{10})")
APPLY_LINE = re.compile(r"splitserve up --apply FILE. while serving")
BASE, A, B, C = "tiny-llama", "tiny-lora-a", "tiny-lora-b", "tiny-lora-c"
PROMPT = "Hello, my name is"


def test_base_and_adapters_through_the_router_and_a_new_list_at_run_time(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    with serving("--engine", "sim", "-f", str(TINY_LORA), "--port", "0", run_dir=run_dir) as up:
        generation = up.wait_for_line(GENERATION_LINE, seconds=60).group(1)
        endpoint = up.wait_for_line(ENDPOINT_LINE, seconds=60).group(1)
        up.wait_for_line(APPLY_LINE, seconds=10)
        client = openai.OpenAI(base_url=endpoint, api_key="unused", max_retries=0, timeout=30)

        def answer(model: str) -> str:
            return client.completions.create(model=model, prompt=PROMPT, max_tokens=8).choices[0].text

        cards = {card.id: card for card in client.models.list().data}
        assert set(cards) == {BASE, A, B}
        assert getattr(cards[A], "parent", None) == BASE and getattr(cards[BASE], "parent", None) is None
        for model in (BASE, A, B):  # through prefill and decode, each leg under the request's adapter
            lora = None if model == BASE else model
            assert answer(model) == generate_text(tokenize(PROMPT), 8, generation, lora), model
        with pytest.raises(openai.NotFoundError) as unknown:
            answer(C)
        assert unknown.value.code == "model_not_found"

        workers = {name: pid for name, pid in pids(up).items() if name != "router"}
        failures: list[str] = []
        done = threading.Event()

        def load() -> None:  # the base model and the adapter that stays, back to back, during the change
            while not done.is_set():
                for model in (BASE, A):
                    try:
                        answer(model)
                    except openai.OpenAIError as error:
                        failures.append(f"{model}: {error}")

        loader = threading.Thread(target=load, daemon=True)
        loader.start()
        changed = tmp_path / "tiny-lora.yaml"
        changed.write_text(
            TINY_LORA.read_text().replace(f"tiny-lora/{B}", f"tiny-lora/{C}").replace(f": {B}", f": {C}")
        )
        try:
            result = run_up("--apply", str(changed), run_dir=run_dir, timeout=120)
        finally:
            done.set()
            loader.join(timeout=30)
        assert result.returncode == 0, result.stdout + result.stderr
        assert f"adapters: {A}, {B} -> {A}, {C}: served in" in result.stdout, result.stdout
        assert "rollout" not in result.stdout and "replicas" not in result.stdout, result.stdout
        assert failures == []
        assert {name: pid for name, pid in pids(up).items() if name != "router"} == workers, "no worker restarted"
        assert answer(C) == generate_text(tokenize(PROMPT), 8, generation, C), "the same KV generation serves C"
        with pytest.raises(openai.NotFoundError):
            answer(B)


def test_smoke_asks_the_base_model_and_an_adapter(tmp_path: Path) -> None:
    up = start_up("--engine", "sim", "-f", str(TINY_LORA), "--port", "0", "--smoke", run_dir=tmp_path)
    assert up.popen.wait(timeout=60) == 0, up.stderr()
    up.wait_for_line(re.compile(r"^answer: '.+'$"), seconds=5)
    up.wait_for_line(re.compile(rf"^answer \({A}\): '.+'$"), seconds=5)
