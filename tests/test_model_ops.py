"""folio.ops dispatch: per-op native kernels with reference fallback, and use_backend."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from folio import ops, reference_ops


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
    ops._load_native.cache_clear()
    yield calls
    ops._load_native.cache_clear()


@pytest.fixture
def no_native(monkeypatch):
    """Pretend the CPU extension was never built, whether or not it is."""
    monkeypatch.setitem(sys.modules, "folio._native_cpu", None)  # makes import raise ModuleNotFoundError
    ops._load_native.cache_clear()
    yield
    ops._load_native.cache_clear()


def test_native_op_is_used_and_others_fall_back(fake_native_cpu) -> None:
    x, w = torch.randn(2, 8), torch.randn(8)
    assert ops.implementation_name("rms_norm", "cpu") == "native"
    assert ops.implementation_name("silu_and_mul", "cpu") == "reference"
    torch.testing.assert_close(ops.rms_norm(x, w, 1e-5), reference_ops.rms_norm(x, w, 1e-5))
    assert fake_native_cpu == [1e-5]
    torch.testing.assert_close(ops.silu_and_mul(x), reference_ops.silu_and_mul(x))


def test_forced_reference_skips_native(fake_native_cpu) -> None:
    with ops.use_backend("reference"):
        assert ops.current_backend() == "reference"
        ops.rms_norm(torch.randn(2, 8), torch.randn(8), 1e-5)
    assert fake_native_cpu == []
    assert ops.current_backend() == "auto"


def test_forced_native_raises_for_a_missing_op(fake_native_cpu) -> None:
    with ops.use_backend("native"):
        ops.rms_norm(torch.randn(2, 8), torch.randn(8), 1e-5)
        with pytest.raises(ops.NativeUnavailableError, match="folio._native_cpu is built without 'silu_and_mul'"):
            ops.silu_and_mul(torch.randn(2, 8))


def test_forced_native_raises_when_not_built(no_native) -> None:
    assert ops.implementation_name("paged_attention", "cpu") == "reference"
    with ops.use_backend("native"), pytest.raises(ops.NativeUnavailableError, match="folio._native_cpu is not built"):
        ops.copy_page_slots(torch.zeros(1, 2, 16, 1, 4), torch.zeros(1, 2, 16, 1, 4), 0, 1, 3)


def test_use_backend_as_a_plain_call_persists() -> None:
    ops.use_backend("reference")
    try:
        assert ops.current_backend() == "reference"
        assert ops.implementation_name("rms_norm", "cpu") == "reference"
    finally:
        ops.use_backend("auto")


def test_use_backend_rejects_unknown_names() -> None:
    with pytest.raises(ValueError, match="unknown ops backend 'fast'"):
        ops.use_backend("fast")
    with pytest.raises(ValueError, match="unknown op 'gelu'"):
        ops.resolve("gelu", "cpu")


def test_broken_native_module_is_an_error(monkeypatch) -> None:
    """An extension that exists but fails to import must not silently become the reference."""
    def broken_import(name, *args, **kwargs):
        if name == "folio._native_cpu":
            raise ImportError("undefined symbol: _ZN3c10")
        return real_import(name, *args, **kwargs)

    real_import = ops.importlib.import_module
    monkeypatch.setattr(ops.importlib, "import_module", broken_import)
    ops._load_native.cache_clear()
    try:
        with pytest.raises(ImportError, match="undefined symbol"):
            ops.rms_norm(torch.randn(2, 8), torch.randn(8), 1e-5)
    finally:
        ops._load_native.cache_clear()


def test_every_op_has_a_reference_with_the_same_name() -> None:
    for name in ops.OP_NAMES:
        assert callable(getattr(reference_ops, name)) and callable(getattr(ops, name))
