"""`make run`'s live config: a YAML file the services watch."""

from __future__ import annotations

import json
import time

import openai
import pytest

from llmesh.testing import wait_until
from tests.e2e.conftest import SMOL

MSG = [{"role": "user", "content": "What is 2+2?"}]


def test_file_edit_applies_live_and_a_bad_edit_is_rejected(client, mesh, config_file):
    config_file.write_text(
        "splits:\n  assistant:\n    targets: [{model: " + SMOL + ", weight: 1}]\n"
        "models:\n  " + SMOL + ":\n    system_prompt: 'Answer in French.'\n")
    t0 = time.monotonic()
    assert wait_until(lambda: "assistant" in {m.id for m in client.models.list()}, 1.0)
    assert time.monotonic() - t0 < 1.0
    resp = client.chat.completions.create(model="assistant", messages=MSG, temperature=0, max_tokens=12)
    assert resp.model == "assistant" and resp.choices[0].message.content
    # the system prompt from the config is in the prompt: more prompt tokens than without it
    plain = client.chat.completions.create(model=SMOL, messages=[{"role": "system", "content": "x"}, *MSG],
                                           temperature=0, max_tokens=1)
    assert resp.usage.prompt_tokens > plain.usage.prompt_tokens

    config_file.write_text("splits:\n  assistant:\n    targets: []\n")  # invalid: no target
    log = mesh.log_dir / "gateway.log"
    assert wait_until(lambda: "config rejected" in log.read_text(), 2.0)
    reason = next(json.loads(x)["reason"] for x in log.read_text().splitlines() if "config rejected" in x)
    assert "targets" in reason
    assert client.chat.completions.create(model="assistant", messages=MSG, max_tokens=2).choices  # last good kept

    config_file.write_text("default: {max_attempts: 2}\n")
    assert wait_until(lambda: "assistant" not in {m.id for m in client.models.list()}, 1.0)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="assistant", messages=MSG)
