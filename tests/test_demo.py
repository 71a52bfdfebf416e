"""The demo model writer and the `folio` command line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from folio.demo import MARKER_FILE, SIZES, is_demo_model_current, write_demo_model
from folio.tokenizer import Tokenizer

REPO_ROOT = Path(__file__).resolve().parent.parent
MODEL_FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_demo_model(tmp_path_factory.mktemp("demo"))


def _folio(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "folio", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )


def test_two_writes_give_identical_files(demo_dir: Path, tmp_path: Path) -> None:
    other = write_demo_model(tmp_path / "again")
    for name in (*MODEL_FILES, MARKER_FILE):
        assert (demo_dir / name).read_bytes() == (other / name).read_bytes(), name


def test_seed_changes_weights_but_not_tokenizer(demo_dir: Path, tmp_path: Path) -> None:
    other = write_demo_model(tmp_path / "seed1", seed=1)
    assert (other / "tokenizer.json").read_bytes() == (demo_dir / "tokenizer.json").read_bytes()
    a, b = load_file(demo_dir / "model.safetensors"), load_file(other / "model.safetensors")
    assert a.keys() == b.keys()
    assert not torch.equal(a["model.layers.0.self_attn.q_proj.weight"], b["model.layers.0.self_attn.q_proj.weight"])


def test_write_is_skipped_when_current_and_redone_when_not(tmp_path: Path) -> None:
    path = write_demo_model(tmp_path / "m")
    weights = path / "model.safetensors"
    mtime_ns = weights.stat().st_mtime_ns
    assert is_demo_model_current(path)
    write_demo_model(path)
    assert weights.stat().st_mtime_ns == mtime_ns

    assert not is_demo_model_current(path, seed=1)
    write_demo_model(path, seed=1)
    assert json.loads((path / MARKER_FILE).read_text())["seed"] == 1

    (path / "tokenizer.json").unlink()  # an incomplete directory is rewritten
    assert not is_demo_model_current(path, seed=1)
    write_demo_model(path, seed=1)
    assert (path / "tokenizer.json").is_file() and is_demo_model_current(path, seed=1)


def test_weights_have_hf_llama_names_shapes_and_init(demo_dir: Path) -> None:
    weights = load_file(demo_dir / "model.safetensors")
    config = json.loads((demo_dir / "config.json").read_text())
    assert config["vocab_size"] == Tokenizer.from_pretrained(demo_dir).vocab_size == 1000
    assert weights["model.embed_tokens.weight"].shape == (1000, SIZES.hidden_size)
    assert weights["lm_head.weight"].shape == (1000, SIZES.hidden_size)
    assert weights["model.layers.3.self_attn.k_proj.weight"].shape == (SIZES.num_kv_heads * SIZES.head_dim, 256)
    assert weights["model.layers.3.mlp.down_proj.weight"].shape == (SIZES.hidden_size, SIZES.intermediate_size)
    assert len(weights) == 2 + 9 * SIZES.num_layers + 1
    assert all(w.dtype == torch.float32 for w in weights.values())
    assert torch.equal(weights["model.norm.weight"], torch.ones(SIZES.hidden_size))
    assert abs(weights["model.layers.1.mlp.up_proj.weight"].std().item() - SIZES.init_std) < 1e-3


def test_loads_in_transformers_with_finite_logits(demo_dir: Path) -> None:
    transformers = pytest.importorskip("transformers")
    model = transformers.LlamaForCausalLM.from_pretrained(demo_dir)
    hf_tok = transformers.AutoTokenizer.from_pretrained(demo_dir)
    tok = Tokenizer.from_pretrained(demo_dir)
    text = "The baker on Mill Street 🙂"
    ids = tok.encode(text, add_bos=tok.add_bos_token)
    assert hf_tok(text).input_ids == ids
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits
    assert logits.shape == (1, len(ids), 1000)
    assert torch.isfinite(logits).all()


def test_cli_demo_model_writes_and_reports(tmp_path: Path) -> None:
    result = _folio("demo-model", "out", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("wrote: demo model (seed 0)")
    for name in MODEL_FILES:
        assert name in result.stdout
    assert is_demo_model_current(tmp_path / "out")
    again = _folio("demo-model", "out", cwd=tmp_path)
    assert again.stdout.startswith("already up to date")


def test_cli_run_streams_the_transformers_greedy_continuation(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    prompt = "The clockmaker"
    # No --model: `folio run` writes the demo model to ./demo-model itself.
    result = _folio("run", "--prompt", prompt, "--max-new-tokens", "8", "--device", "cpu", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    model_dir = tmp_path / "demo-model"
    assert is_demo_model_current(model_dir)

    tok = Tokenizer.from_pretrained(model_dir)
    prompt_ids = tok.encode(prompt, add_bos=True)
    model = transformers.LlamaForCausalLM.from_pretrained(model_dir)
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=8, do_sample=False, eos_token_id=None)
    new_ids = out[0, len(prompt_ids) :].tolist()
    expected = prompt + b"".join(tok.token_bytes(i) for i in new_ids).decode("utf-8", errors="replace")
    assert result.stdout == expected + "\n"
    assert f"{len(prompt_ids)} prompt + 8 new tokens" in result.stderr


def test_cli_run_rejects_too_long_requests(demo_dir: Path, tmp_path: Path) -> None:
    result = _folio("run", "--model", str(demo_dir), "--max-new-tokens", "5000", "--device", "cpu", cwd=tmp_path)
    assert result.returncode == 2
    assert "max_position_embeddings 4096" in result.stderr


def test_cli_needs_a_command(tmp_path: Path) -> None:
    result = _folio(cwd=tmp_path)
    assert result.returncode == 2
    assert "demo-model" in result.stderr and "run" in result.stderr
