import sys, json, torch
sys.path.insert(0, "tests")
from tiny_models import make_hf_model, load_hf_model, hf_logits
from folio.model.model import Model
from folio.kv_cache import Cache
from folio.model.batch import ForwardBatch, SeqChunk
from folio.options import EngineOptions
def rel(a, b): return ((a - b).abs().max() / b.abs().max()).item()
ids = list(range(3, 64))
for arch, kw in [("gemma2", dict(sliding_window=20)), ("gemma2", dict(sliding_window=512)), ("gemma2", dict(sliding_window=512, attn_logit_softcapping=None))]:
    path = make_hf_model(f"/tmp/d_{arch}_{len(kw)}_{kw.get('sliding_window')}_{kw.get('attn_logit_softcapping', 1)}", arch, **kw)
    want = hf_logits(load_hf_model(path), ids)
    for backend in ("auto", "reference"):
        for mode in ("whole", "decode"):
            m = Model.from_pretrained(path, device="cuda", progress=False, options=EngineOptions(ops_backend=backend))
            cache = Cache(m, num_tokens=128, page_size=16)
            t = [5, 2, 7, 0, 1]
            if mode == "whole":
                got = m.forward(ForwardBatch.build([SeqChunk(ids, 0, t, "all")], 16, m.device), cache)
            else:
                got = torch.cat([m.forward(ForwardBatch.build([SeqChunk([x], i, t, "last")], 16, m.device), cache) for i, x in enumerate(ids)])
            print(arch, kw, backend, mode, rel(got.cpu(), want), flush=True)
for arch in ("mixtral", "qwen3_moe"):
    path = make_hf_model(f"/tmp/d_{arch}", arch)
    want = hf_logits(load_hf_model(path), ids)
    hfb = load_hf_model(path, dtype=torch.bfloat16)
    print(arch, "hf bf16 vs fp32", rel(hf_logits(hfb, ids), want))
