"""``python -m bench.prompt_tokens``: a short run on SmolLM2's GGUF reports each chat length's
tokens and both modes' loop stalls and wall times; the lone question is tokenized in place
either way, the 12-message chats on a thread, and an embeddings request's short inputs together."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from llmesh.gateway.domain.prompt_tokens import AHEAD_CHARS

ROOT = Path(__file__).resolve().parents[2]


def test_a_short_run_reports_every_length_in_both_modes(real_model_dir):
    done = subprocess.run([sys.executable, "-m", "bench.prompt_tokens", "--json", "--rounds", "1", "--requests", "2",
                           "--inputs", "64"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout)
    assert out["bench"] == "prompt_tokens" and out["ahead_chars"] == AHEAD_CHARS
    cells = [c for c in out["tokenizers"]["gguf"]["cells"] if c["kind"] == "chat"]
    tokens = [c["prompt_tokens"] for c in cells]
    assert len(cells) == 6 and tokens == sorted(tokens) and tokens[0] > 0
    assert [c["worth_a_thread"] for c in cells] == [False] + [True] * 5
    for cell in cells:
        assert cell["tokenize_ms_p50"] > 0
        for mode in ("inline", "ahead"):
            assert cell[mode]["wall_ms"] > 0 and cell[mode]["loop_stall_ms_max"] >= cell[mode]["loop_stall_ms_p99"]
    # an embeddings request's short inputs: in place each alone, on a thread together
    [batch] = [c for c in out["tokenizers"]["gguf"]["cells"] if c["kind"] == "embeddings"]
    assert batch["inputs"] == 64 and batch["messages"] == 0 and batch["worth_a_thread"]
    assert batch["prompt_tokens"] > 64 and batch["prompt_chars"] < 64 * AHEAD_CHARS
    assert batch["ahead"]["wall_ms"] > 0 and batch["inline"]["wall_ms"] > 0
