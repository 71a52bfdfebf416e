"""Write a random-weight Llama checkpoint of a benchmark shape, servable by `folio serve` (the GPU machine has no
model weights to download): config.json of the shape, the demo model's tokenizer (so its vocabulary replaces the
shape's), bf16 weights of Llama's init scale made on the GPU when there is one, in safetensors shards of a few
layers each with their index.

    python bench/make_checkpoint.py --shape 8B --out /tmp/llama-8b-random
    python bench/make_checkpoint.py --shape tiny --out /tmp/tiny --device cpu
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tp_engine import SHAPES_TP  # noqa: E402

from folio.demo import write_demo_model  # noqa: E402
from folio.model.config import ModelConfig  # noqa: E402
from folio.model.loader import INDEX_FILE, expected_shapes  # noqa: E402

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")
LAYERS_PER_FILE = 4


def write_checkpoint(shape: str, out: str | Path, device: str = "cuda", seed: int = 0) -> Path:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        demo = write_demo_model(Path(tmp) / "demo")
        for name in TOKENIZER_FILES:
            shutil.copy(demo / name, out / name)
        raw = json.loads((demo / "config.json").read_text())
    sizes = {k: v for k, v in SHAPES_TP[shape].items() if k != "vocab_size"}  # the tokenizer's vocabulary stays
    raw.update(sizes, head_dim=sizes["hidden_size"] // sizes["num_attention_heads"], torch_dtype="bfloat16",
               max_position_embeddings=131072, rope_theta=500000.0)
    raw.pop("dtype", None)
    (out / "config.json").write_text(json.dumps(raw, indent=1))
    config = ModelConfig.from_dict(raw)
    gen = torch.Generator(device=device).manual_seed(seed)
    def file_of(name: str) -> str:
        if not name.startswith("model.layers."):
            return "model-rest.safetensors"
        return f"model-layers-{int(name.split('.')[2]) // LAYERS_PER_FILE:03d}.safetensors"

    weight_map = {name: file_of(name) for name in expected_shapes(config)}
    by_file: dict[str, list[str]] = {}
    for name, file in weight_map.items():
        by_file.setdefault(file, []).append(name)
    shapes = expected_shapes(config)
    for file, file_names in by_file.items():  # one file's tensors in memory at a time
        tensors = {}
        for name in file_names:
            if len(shapes[name]) == 1:  # norms
                tensors[name] = torch.ones(shapes[name], dtype=torch.bfloat16)
            else:
                tensors[name] = (torch.randn(shapes[name], device=device, generator=gen) * 0.02).to(
                    torch.bfloat16).cpu()
        save_file(tensors, str(out / file), metadata={"format": "pt"})
    (out / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=1))
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="8B", choices=sorted(SHAPES_TP))
    parser.add_argument("--out", required=True)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    t0 = time.perf_counter()
    out = write_checkpoint(args.shape, args.out, args.device)
    size = sum(f.stat().st_size for f in out.glob("*.safetensors"))
    print(f"{args.shape}: {size / 1e9:.1f} GB in {out} ({time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
