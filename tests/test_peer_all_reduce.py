"""The choice of all-reduce for a tensor-parallel replica (folio.model.peer_all_reduce) where no GPU is: the option is
checked, "peer" is refused with the reason, "auto" and "nccl" leave the sums to the process group without running a
collective. The kernel itself is tested on two GPUs (test_peer_all_reduce_gpu.py)."""

from __future__ import annotations

import pytest
import torch

from folio.model import peer_all_reduce
from folio.model.tensor_parallel import TensorParallel
from folio.options import EngineOptions


def test_the_option_takes_its_three_modes_only():
    for mode in ("auto", "peer", "nccl"):
        assert EngineOptions(tp_all_reduce=mode).tp_all_reduce == mode
    with pytest.raises(ValueError, match="tp_all_reduce"):
        EngineOptions(tp_all_reduce="nvls")


def test_on_the_cpu_peer_is_refused_and_auto_keeps_the_process_group():
    tp = TensorParallel(rank=0, world_size=2)  # (no process group: a collective here would fail)
    cpu = torch.device("cpu")
    with pytest.raises(peer_all_reduce.PeerAllReduceUnavailable, match="needs CUDA devices"):
        peer_all_reduce.attach(tp, cpu, "peer")
    for mode in ("auto", "nccl"):
        attached = peer_all_reduce.attach(tp, cpu, mode)
        assert attached is tp
    assert peer_all_reduce.attach(None, cpu, "peer") is None
    assert peer_all_reduce.attach(TensorParallel(0, 1), cpu, "peer") is None


def test_nccl_drops_a_peer_the_ranks_hold_and_auto_keeps_it():
    held = peer_all_reduce.PeerAllReduce(native=object(), max_bytes=1 << 20)
    tp = TensorParallel(rank=1, world_size=2, peer=held)
    assert peer_all_reduce.attach(tp, torch.device("cuda", 1), "nccl").peer is None
    # a model built again over the same ranks reuses it: no second collective
    assert peer_all_reduce.attach(tp, torch.device("cuda", 1), "auto").peer is held
    assert peer_all_reduce.attach(tp, torch.device("cuda", 1), "peer").peer is held


def test_the_messages_it_takes_are_whole_vectors_up_to_its_slots():
    fits = peer_all_reduce.fits
    assert fits(1024, torch.float32, 1024) and fits(16, torch.bfloat16, 1024) and fits(32, torch.float16, 1024)
    assert not fits(1040, torch.float32, 1024)  # over the slot: NCCL
    assert not fits(6, torch.bfloat16, 1024)  # not whole 16-byte vectors
    assert not fits(0, torch.float32, 1024)  # nothing to send: no launch (every rank alike)
    assert not fits(64, torch.int32, 1024)
    # CPU tensors never: the process group (gloo) sums them
    assert not peer_all_reduce.PeerAllReduce(native=None, max_bytes=1024).takes(torch.zeros(8))
