"""``llmesh up --engines vllm:N``: vllm engines serve --vllm-model, a Hugging Face directory of
the model dir (the gateway reads its tokenizer there), under that folder's name; vLLM's own
settings pass through as LLMESH_ENGINE_VLLM_*. The mesh itself: tests/e2e/test_vllm_mesh.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from llmesh.cli.main import _banner, _up_options, build_parser, parse_engines
from llmesh.cli.up import plan


def up_args(tmp_path: Path, *more: str):
    return build_parser().parse_args(["up", "--model-dir", str(tmp_path / "models"), "--log-dir",
                                      str(tmp_path / "logs"), *more])


def hf_folder(tmp_path: Path, name: str) -> Path:
    folder = tmp_path / "models" / name
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    return folder


def test_vllm_is_an_engine_backend():
    assert parse_engines("vllm:2,sim") == ["vllm", "vllm", "sim"]
    with pytest.raises(ValueError, match=r"\(llamacpp, sim, vllm, minilm\)"):
        parse_engines("tgi")


def test_vllm_engines_serve_the_hf_folder_under_its_name(tmp_path, monkeypatch):
    monkeypatch.setenv("LLMESH_ENGINE_VLLM_DTYPE", "float32")  # vLLM's settings reach the engines as they are
    folder = hf_folder(tmp_path, "my-hf-model")
    spec, _, _ = _up_options(up_args(tmp_path, "--engines", "vllm:2,sim", "--vllm-model", "my-hf-model"))
    engines = [c for c in plan(spec) if c.name.startswith("engine-")]
    assert [c.env["LLMESH_ENGINE_BACKEND"] for c in engines] == ["vllm", "vllm", "sim"]
    for child in engines[:2]:
        assert child.env["LLMESH_ENGINE_MODEL"] == "my-hf-model"
        assert child.env["LLMESH_ENGINE_VLLM_MODEL_PATH"] == str(folder.resolve())
        assert child.env["LLMESH_ENGINE_VLLM_DTYPE"] == "float32"
    assert engines[2].env["LLMESH_ENGINE_MODEL"] == "sim-small"
    assert "LLMESH_ENGINE_VLLM_MODEL_PATH" not in engines[2].env
    assert '"model": "my-hf-model"' in _banner(spec.layout, spec)


def test_vllm_engines_need_a_hf_folder_in_the_model_dir(tmp_path):
    with pytest.raises(ValueError, match="no Hugging Face model directory 'smollm2-135m-instruct-hf-fp32'"):
        _up_options(up_args(tmp_path, "--engines", "vllm"))
    (tmp_path / "models" / "weights-only").mkdir(parents=True)  # no config.json: not a model vLLM can load
    with pytest.raises(ValueError, match="'weights-only'"):
        _up_options(up_args(tmp_path, "--engines", "vllm", "--vllm-model", "weights-only"))


def test_a_dead_childs_leftover_processes_are_killed(tmp_path):
    """A kill -9 of a vllm engine leaves vLLM's engine core (a process the engine started) running
    with its memory: the supervisor kills what is left of the dead child's process group."""
    import os
    import time

    from llmesh.cli.up import Child
    from llmesh.testing import pid_alive, wait_until

    (tmp_path / "leaver.py").write_text(
        "import subprocess, sys\n"
        "core = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
        f"open({str(tmp_path / 'core.pid')!r}, 'w').write(str(core.pid))\n")
    child = Child("engine-0", "leaver", "127.0.0.1:1", {**os.environ, "PYTHONPATH": str(tmp_path)},
                  tmp_path / "engine-0.log")
    child.start()
    child.process.wait(timeout=30)
    core = int((tmp_path / "core.pid").read_text())
    time.sleep(0.2)
    assert pid_alive(core)  # it outlived its parent
    child.reap_group()
    assert wait_until(lambda: not pid_alive(core), 10)
    child.reap_group()  # nothing left: no error


def test_up_serves_the_embedder_unless_told_not_to(tmp_path):
    """`llmesh up` (`make run`) adds a minilm engine for all-minilm-l6-v2 when the model is in the
    store, after the --engines ones; --no-embeddings, or no such model, starts none."""
    (tmp_path / "models" / "all-minilm-l6-v2").mkdir(parents=True)
    assert not _up_options(up_args(tmp_path, "--engines", "sim"))[0].embeddings  # no weights: nothing to serve
    (tmp_path / "models" / "all-minilm-l6-v2" / "model.safetensors").write_bytes(b"")
    spec, _, _ = _up_options(up_args(tmp_path, "--engines", "sim"))
    engines = [c for c in plan(spec) if c.name.startswith("engine-")]
    assert [(c.name, c.env["LLMESH_ENGINE_BACKEND"], c.env["LLMESH_ENGINE_MODEL"]) for c in engines] == [
        ("engine-0", "sim", "sim-small"), ("engine-1", "minilm", "all-minilm-l6-v2")]
    assert "/v1/embeddings" in _banner(spec.layout, spec)
    off, _, _ = _up_options(up_args(tmp_path, "--engines", "sim", "--no-embeddings"))
    assert [c.env["LLMESH_ENGINE_BACKEND"] for c in plan(off) if c.name.startswith("engine-")] == ["sim"]
    assert "/v1/embeddings" not in _banner(off.layout, off)
