"""Shared fixtures: the demo model, and a 'peaked' model (the demo tokenizer over weights with a wide spread) whose
greedy choices are far from ties, so equivalence tests compare exact token ids."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

# The CI machine has two cores and some tests run servers beside the test process: one intra-op thread is both
# faster there and deterministic.
torch.set_num_threads(1)

DEMO_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")

# A test that starts or uses a local Ray cluster (marker `ray`) gets this limit from pytest-timeout, tighter than
# pyproject's default: the cluster's start and deployment (about 20 s here) count against the test that first uses
# it, and a loaded 2-core CI machine is several times slower. A test's own timeout marker wins.
RAY_TEST_TIMEOUT_S = 300


def pytest_collection_modifyitems(config, items):
    if not config.pluginmanager.hasplugin("timeout"):  # pytest-timeout (the test extra) is not installed
        return
    for item in items:
        if item.get_closest_marker("ray") and not item.get_closest_marker("timeout"):
            item.add_marker(pytest.mark.timeout(RAY_TEST_TIMEOUT_S))


@pytest.fixture(scope="session")
def demo_dir(tmp_path_factory) -> Path:
    from folio.demo import write_demo_model

    path = tmp_path_factory.mktemp("demo-model")
    write_demo_model(path)
    return path


@pytest.fixture(scope="session")
def peaked_dir(tmp_path_factory, demo_dir) -> Path:
    import json

    from tiny_models import make_hf_model

    config = json.loads((demo_dir / "config.json").read_text())
    path = tmp_path_factory.mktemp("peaked-model")
    make_hf_model(path, "llama", vocab_size=config["vocab_size"], max_position_embeddings=1024,
                  bos_token_id=config.get("bos_token_id"), eos_token_id=config.get("eos_token_id"))
    for name in DEMO_TOKENIZER_FILES:
        if (demo_dir / name).exists():
            shutil.copy(demo_dir / name, path / name)
    return path


class EngineParts:
    def __init__(self, path: Path):
        import folio

        self.path = path
        self.model = folio.Model.from_pretrained(path, progress=False)
        self.tokenizer = folio.Tokenizer.from_pretrained(path)

    def generator(self, num_tokens: int = 4096, page_size: int = 16, **kwargs):
        import folio

        cache = folio.Cache(self.model, num_tokens=num_tokens, page_size=page_size)
        return folio.DynamicGenerator(model=self.model, cache=cache, tokenizer=self.tokenizer, **kwargs)


@pytest.fixture(scope="session")
def peaked(peaked_dir) -> EngineParts:
    return EngineParts(peaked_dir)


@pytest.fixture(scope="session")
def demo(demo_dir) -> EngineParts:
    return EngineParts(demo_dir)


@pytest.fixture(params=["native", "python"])
def held_keys_implementation(request, monkeypatch):
    """folio.router.index builds its held-key store (folio.router.held_keys) as the native one or its Python twin;
    tests that use this fixture run over both."""
    from folio.ops import native_key_index
    from folio.router import index
    from folio.router.held_keys import PyHeldKeys

    if request.param == "native":
        native = native_key_index()
        if native is None:
            pytest.skip("folio._native_cpu is not built")
        monkeypatch.setattr(index, "make_held_keys", native)
    else:
        monkeypatch.setattr(index, "make_held_keys", PyHeldKeys)
    return request.param
