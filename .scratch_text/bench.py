import time, random, torch
from folio.sampling import RowParams, SamplerSettings, sample
cases = [(256, 152064, 2000, SamplerSettings(), False), (256, 152064, 2000, SamplerSettings(), True),
         (256, 152064, 8000, SamplerSettings(), True),
         (256, 152064, 2000, SamplerSettings(top_k=0, top_p=0.9), True),
         (256, 152064, 0, SamplerSettings.greedy(), False), (1, 152064, 2000, SamplerSettings(), False)]
for B, V, hist, s, as_tensor in cases:
    logits = torch.randn(B, V, device="cuda")
    rng = random.Random(0)
    hists = [[rng.randrange(V) for _ in range(hist)] for _ in range(B)]
    if as_tensor: hists = [torch.tensor(h, dtype=torch.int64) for h in hists]
    rows = [RowParams(s, 0.5, history_ids=h) for h in hists]
    for _ in range(3): sample(logits, rows)
    torch.cuda.synchronize()
    t = time.perf_counter(); n = 20
    for _ in range(n): out = sample(logits, rows)
    host = (time.perf_counter() - t) / n
    torch.cuda.synchronize(); total = (time.perf_counter() - t) / n
    print(f"B={B} V={V} hist={hist} tensor={as_tensor} top_k={s.top_k} top_p={s.top_p}: host {host*1e3:.2f} ms, total {total*1e3:.2f} ms/call")
