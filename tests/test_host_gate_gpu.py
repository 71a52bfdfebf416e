"""folio.constrain.gate on CUDA: the device's stream waits for the host's value, and a generator that queues its
sampler before the grammar masks exist (the gate) produces what it produces without the gate."""

from __future__ import annotations

import json
import time

import pytest
import torch
from test_constrained_gpu import run_to_end

import folio
from folio.constrain.gate import HostGate
from folio.ops import OpSet
from folio.options import EngineOptions

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

SCHEMA = {"type": "object", "properties": {"word": {"type": "string", "maxLength": 10},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["word", "n"], "additionalProperties": False}


def test_the_stream_waits_until_the_host_opens_the_gate():
    gate = HostGate.for_device(OpSet(), torch.device("cuda"))
    assert gate is not None
    host = torch.full((4,), 7, dtype=torch.int64).pin_memory()
    value = gate.arm()
    on_device = host.to("cuda", non_blocking=True)  # queued after the wait
    copied = torch.cuda.Event()
    copied.record()
    time.sleep(0.2)
    assert not copied.query()  # the copy has not run: the device waits
    host.fill_(9)  # written after the copy was queued, before the gate opens: the copy must see it
    gate.open(value)
    copied.synchronize()
    assert on_device.tolist() == [9, 9, 9, 9]
    # a second arm waits for the next value only
    second = gate.arm()
    done = torch.cuda.Event()
    done.record()
    time.sleep(0.05)
    assert not done.query()
    gate.open(second)
    done.synchronize()


def test_another_thread_opens_the_gate_while_this_one_waits_on_the_device():
    """The generator's order: the masks' worker opens the gate, while the step's thread queues more work and
    waits on the device meanwhile."""
    import threading

    gate = HostGate.for_device(OpSet(), torch.device("cuda"))
    host = torch.full((4,), 3, dtype=torch.int64).pin_memory()
    value = gate.arm()
    on_device = host.to("cuda", non_blocking=True)

    def write_and_open():
        time.sleep(0.2)
        host.fill_(5)
        gate.open(value)

    opener = threading.Thread(target=write_and_open)
    opener.start()
    # a copy back waits on the device until the gate opens; the copy queued behind the gate saw what was written
    assert (on_device + 1).tolist() == [6, 6, 6, 6]
    opener.join(timeout=10)


def run_constrained(demo_dir, gated: bool) -> tuple[list[list[int]], int]:
    from folio.constrain import JsonSchemaFilter, RegexFilter

    model = folio.Model.from_pretrained(demo_dir, device="cuda", dtype=torch.bfloat16, progress=False,
                                        options=EngineOptions(ops_backend="native"))
    tok = folio.Tokenizer.from_pretrained(demo_dir)
    cache = folio.Cache(model, num_tokens=8192, page_size=16)
    gen = folio.DynamicGenerator(model=model, cache=cache, tokenizer=tok, max_batch_size=16, cuda_graphs=True,
                                 decode_ahead=True, overlap_emit=True)
    assert gen.masks.gate is not None
    if not gated:
        gen.masks.gate = None
    sampled = folio.SamplerSettings(temperature=1.0, top_k=50, top_p=0.9, token_repetition_penalty=1.05)
    prompt = tok.encode("The list of words:")
    jobs = [folio.DynamicJob(input_ids=prompt, max_new_tokens=200, gen_settings=sampled, seed=s,
                             filters=[JsonSchemaFilter(SCHEMA)]) for s in range(6)]
    jobs += [folio.DynamicJob(input_ids=prompt, max_new_tokens=40, gen_settings=sampled, seed=s,
                              filters=[RegexFilter(r"[a-z]{2,6}( [a-z]{2,6}){3}")]) for s in range(3)]
    jobs += [folio.DynamicJob(input_ids=prompt, max_new_tokens=40, gen_settings=sampled, seed=s, stop_conditions=[])
             for s in range(3)]
    finals = run_to_end(gen, jobs, max_steps=2000)
    for job in jobs:
        assert finals[job].eos_reason != folio.EosReason.ERROR, finals[job].error
    for job in jobs[:6]:
        completion = json.loads(job.full_completion)
        assert set(completion) == {"word", "n"} and 0 <= completion["n"] <= 99
    return [job.full_completion for job in jobs], 0 if gen.masks.gate is None else gen.masks.gate.num_armed


def test_gated_sampling_gives_what_ungated_sampling_gives(demo_dir):
    gated, armed = run_constrained(demo_dir, gated=True)
    ungated, _ = run_constrained(demo_dir, gated=False)
    assert armed > 20  # most decode steps queued their sampler before the masks existed
    assert gated == ungated
