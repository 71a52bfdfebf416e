"""folio.ops.OpSet dispatch: per-op native kernels with reference fallback, backends, CUDA launch options, and the
clear error on a CUDA device without the native CUDA module."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from folio import ops, reference_ops
from folio.model.model import Model
from folio.options import EngineOptions


@pytest.fixture
def fake_native_cpu(monkeypatch):
    """A stand-in `folio._native_cpu` that implements only rms_norm (and records its calls)."""
    calls = []
    module = types.ModuleType("folio._native_cpu")

    def rms_norm(x, weight, eps):
        calls.append(eps)
        return reference_ops.rms_norm(x, weight, eps)

    module.rms_norm = rms_norm
    monkeypatch.setitem(sys.modules, "folio._native_cpu", module)
    return calls


@pytest.fixture
def no_native(monkeypatch):
    """Pretend neither extension was ever built, whether or not it is."""
    monkeypatch.setitem(sys.modules, "folio._native_cpu", None)  # makes import raise ModuleNotFoundError
    monkeypatch.setitem(sys.modules, "folio._native_cuda", None)


class _OnCuda:
    """Stands in for a CUDA tensor where only the device is read (this machine may have no CUDA)."""

    device = torch.device("cuda", 0)


@pytest.fixture
def fake_native_cuda(monkeypatch):
    """A stand-in `folio._native_cuda` whose ops record their keyword arguments (the launch options)."""
    calls = []
    module = types.ModuleType("folio._native_cuda")
    for name in ("rms_norm", "paged_attention_decode", "copy_page_slots", "sample_rows", "linear"):
        def op(*args, _name=name, **kwargs):
            calls.append((_name, len(args), kwargs))
        setattr(module, name, op)
    monkeypatch.setitem(sys.modules, "folio._native_cuda", module)
    return calls


def test_native_op_is_used_and_others_fall_back(fake_native_cpu) -> None:
    op_set = ops.OpSet()
    x, w = torch.randn(2, 8), torch.randn(8)
    assert op_set.implementation_name("rms_norm", "cpu") == "native"
    assert op_set.implementation_name("silu_and_mul", "cpu") == "reference"
    torch.testing.assert_close(op_set.rms_norm(x, w, 1e-5), reference_ops.rms_norm(x, w, 1e-5))
    assert fake_native_cpu == [1e-5]
    torch.testing.assert_close(op_set.silu_and_mul(x), reference_ops.silu_and_mul(x))


def test_reference_backend_skips_native(fake_native_cpu) -> None:
    op_set = ops.OpSet("reference")
    op_set.rms_norm(torch.randn(2, 8), torch.randn(8), 1e-5)
    assert fake_native_cpu == []
    assert op_set.implementation_name("rms_norm", "cpu") == "reference"
    assert op_set.native("sample_rows", "cpu") is None  # the sampler then runs its torch code
    assert ops.OpSet().implementation_name("rms_norm", "cpu") == "native"  # another op set is unaffected


def test_native_backend_raises_for_a_missing_op(fake_native_cpu) -> None:
    op_set = ops.OpSet("native")
    op_set.rms_norm(torch.randn(2, 8), torch.randn(8), 1e-5)
    with pytest.raises(ops.NativeUnavailableError, match="folio._native_cpu is built without 'silu_and_mul'"):
        op_set.silu_and_mul(torch.randn(2, 8))
    with pytest.raises(ops.NativeUnavailableError, match="for \\['cuda'\\] only"):
        op_set.linear(torch.randn(2, 8), torch.randn(3, 8))


def test_native_backend_raises_when_not_built(no_native) -> None:
    assert ops.OpSet().implementation_name("paged_attention", "cpu") == "reference"
    with pytest.raises(ops.NativeUnavailableError, match="folio._native_cpu is not built"):
        ops.OpSet("native").copy_page_slots(torch.zeros(1, 2, 16, 1, 4), torch.zeros(1, 2, 16, 1, 4), 0, 1, 3)


def test_op_without_reference_needs_its_kernel(no_native) -> None:
    op_set = ops.OpSet()
    assert op_set.native("sample_rows", "cpu") is None
    with pytest.raises(ops.NativeUnavailableError, match="no folio.reference_ops fallback"):
        op_set.sample_rows(torch.zeros(1, 4), *[torch.zeros(1)] * 5)


def test_unknown_backend_kernel_and_op_are_refused() -> None:
    with pytest.raises(ValueError, match="unknown ops backend 'fast'"):
        ops.OpSet("fast")
    with pytest.raises(ValueError, match="unknown decode_attention 'wmma'"):
        ops.OpSet(decode_attention="wmma")
    with pytest.raises(ValueError, match="unknown op 'gelu'"):
        ops.OpSet().resolve("gelu", "cpu")


def test_broken_native_module_is_an_error(monkeypatch) -> None:
    """An extension that exists but fails to import must not silently become the reference."""
    def broken_import(name, *args, **kwargs):
        if name == "folio._native_cpu":
            raise ImportError("undefined symbol: _ZN3c10")
        return real_import(name, *args, **kwargs)

    real_import = ops.importlib.import_module
    monkeypatch.setattr(ops.importlib, "import_module", broken_import)
    with pytest.raises(ImportError, match="undefined symbol"):
        ops.OpSet().rms_norm(torch.randn(2, 8), torch.randn(8), 1e-5)


def test_cuda_kernels_get_the_launch_options(fake_native_cuda) -> None:
    """pdl and use_mma reach exactly the CUDA ops the registry gives them, as keyword arguments."""
    cuda = _OnCuda()
    op_set = ops.OpSet.from_options(EngineOptions(pdl=False, decode_attention="simt"))
    op_set.rms_norm(cuda, None, 1e-6)
    op_set.paged_attention_decode(cuda, None, None, None, None, 0.5)
    op_set.copy_page_slots(cuda, None, 0, 1, 2)
    op_set.sample_rows(cuda, None, None, None, None, None)
    op_set.linear(cuda, None, silu_gate=True)
    ops.OpSet().paged_attention_decode(cuda, None, None, None, None, 0.5)
    assert fake_native_cuda == [
        ("rms_norm", 3, {"pdl": False}),
        ("paged_attention_decode", 6, {"pdl": False, "use_mma": False}),
        ("copy_page_slots", 5, {}),
        ("sample_rows", 6, {}),
        ("linear", 2, {"pdl": False, "silu_gate": True}),
        ("paged_attention_decode", 6, {"pdl": True, "use_mma": True}),
    ]


def test_cpu_kernels_get_no_launch_options(monkeypatch) -> None:
    seen = []
    module = types.ModuleType("folio._native_cpu")
    module.paged_attention_decode = lambda *args, **kwargs: seen.append(kwargs)
    monkeypatch.setitem(sys.modules, "folio._native_cpu", module)
    ops.OpSet(pdl=False, decode_attention="simt").paged_attention_decode(torch.zeros(1), None, None, None, None, 1.0)
    assert seen == [{}]


def test_linear_supported_needs_the_native_kernel(fake_native_cuda, monkeypatch) -> None:
    monkeypatch.setattr(ops, "linear_supported", lambda x, weight, bias=None: True)  # the shape checks pass
    assert ops.OpSet().linear_supported(None, None)
    assert not ops.OpSet("reference").linear_supported(None, None)


# --- a CUDA device without the native CUDA module (checked without CUDA: device type and availability are inputs)


@pytest.mark.parametrize("command", ["pip install --no-build-isolation -e .", "python setup.py build_ext --inplace",
                                     "ops_backend='reference'"])
def test_auto_on_cuda_without_the_module_says_how_to_build_it(command) -> None:
    error = ops.missing_native_error("auto", "cuda", module_available=False)
    assert "folio._native_cuda is not built" in error and command in error


def test_missing_native_error_cases() -> None:
    assert ops.missing_native_error("auto", "cuda", module_available=True) is None
    assert ops.missing_native_error("reference", "cuda", module_available=False) is None  # explicit choice
    assert ops.missing_native_error("auto", "cpu", module_available=False) is None  # reference fallback per op
    assert "folio._native_cpu is not built" in ops.missing_native_error("native", "cpu", module_available=False)
    assert "no native module for device type 'mps'" in ops.missing_native_error("native", "mps", False)


def test_model_on_cuda_without_the_module_raises_before_touching_the_device(no_native) -> None:
    with pytest.raises(RuntimeError, match="pip install --no-build-isolation -e ."):
        Model(config=None, weights=None, device=torch.device("cuda", 0), dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="folio._native_cuda is not built"):
        Model.from_state_dict(None, {"w": torch.zeros(1)}, device="cuda:0",
                              options=EngineOptions(ops_backend="native"))
    ops.OpSet("reference").check_device("cuda")  # running the reference ops on CUDA is an explicit option
    ops.OpSet().check_device("cpu")


def test_engine_and_kernels_read_no_environment_variable() -> None:
    """Switches are EngineOptions, passed down as arguments: nothing in folio/ or native/ reads the environment
    (setup.py, the build entry point, does; bench/ scripts map their flags onto EngineOptions)."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    sources = [*root.glob("folio/**/*.py"), *root.glob("native/**/*.py"),
               *(p for ext in ("cpp", "h", "cu", "cuh") for p in root.glob(f"native/**/*.{ext}"))]
    assert len(sources) > 30
    readers = [str(p.relative_to(root)) for p in sources
               if any(call in p.read_text() for call in ("os.environ", "os.getenv", "getenv("))]
    assert readers == []
