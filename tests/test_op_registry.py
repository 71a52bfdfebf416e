"""The op registry (folio/op_registry.py) against everything that restates an op's signature.

Checked here: folio.reference_ops' functions, OpSet's generated methods, the one def list of both pybind modules
(native/bindings/op_signatures.h, parsed), the built CPU module (pybind's docstrings) and, on a GPU machine, the
built CUDA module. An op missing from any of them, an extra op in a binding, or a difference in argument names,
order, defaults or launch options fails.
"""

from __future__ import annotations

import importlib
import inspect
import re
import runpy
from pathlib import Path

import native_reference
import pytest
import torch
from test_native_ops import _import_native

from folio import op_registry, ops, reference_ops
from folio.op_registry import LAUNCH_OPTION_DEFAULTS, OPS
from folio.options import EngineOptions

ROOT = Path(__file__).resolve().parents[1]
SIGNATURES_H = ROOT / "native" / "bindings" / "op_signatures.h"
BINDING_FILES = {"cpu": ROOT / "native/bindings/cpu_module.cpp", "cuda": ROOT / "native/bindings/cuda_module.cpp"}
LAUNCH_MACROS = {"NONE": (), "PDL": ("pdl",), "PDL_MMA": ("pdl", "use_mma")}
CPP_DEFAULTS = {"py::none()": None, "false": False, "true": True}

# A signature as the checks compare it: ((name, default or _NO_DEFAULT), ...) positional, then the keyword-only
# launch options the same way.
_NO_DEFAULT = "<none>"


def registry_signature(spec: op_registry.OpSpec, device_type: str) -> tuple[tuple, tuple]:
    args = tuple((a, spec.defaults.get(a, _NO_DEFAULT)) for a in spec.args)
    launch = tuple((o, LAUNCH_OPTION_DEFAULTS[o]) for o in spec.launch) if device_type == "cuda" else ()
    return args, launch


# --- the registry itself ---


def test_registry_is_well_formed() -> None:
    names = [spec.name for spec in OPS]
    assert len(names) == len(set(names)), "an op is listed twice"
    assert set(op_registry.BY_NAME) == set(names)
    for spec in OPS:
        assert spec.args and len(spec.args) == len(set(spec.args)), spec.name
        assert spec.native <= set(op_registry.NATIVE_MODULES), spec.name
        # defaults only on trailing arguments (else the signature is not valid Python)
        with_default = [a in spec.defaults for a in spec.args]
        assert with_default == sorted(with_default), f"{spec.name}: a defaulted argument precedes a required one"


def test_launch_option_defaults_are_engine_option_defaults() -> None:
    defaults = EngineOptions()
    assert LAUNCH_OPTION_DEFAULTS == {"pdl": defaults.pdl, "use_mma": defaults.decode_attention == "mma"}


def test_module_lists_match_sources() -> None:
    sources = runpy.run_path(str(ROOT / "native" / "sources.py"))  # the build's one source list
    assert {sources["CPU_MODULE"], sources["CUDA_MODULE"]} == set(op_registry.NATIVE_MODULES.values())


# --- the references ---


@pytest.mark.parametrize("spec", [s for s in OPS if s.has_reference_op], ids=lambda s: s.name)
def test_reference_op_matches_registry(spec) -> None:
    params = inspect.signature(getattr(reference_ops, spec.name)).parameters.values()
    got = tuple((p.name, _NO_DEFAULT if p.default is inspect.Parameter.empty else p.default) for p in params)
    assert got == registry_signature(spec, "cpu")[0]


def test_every_reference_op_is_registered() -> None:
    # folio.reference_ops re-exports the quantized-cache ops of folio.reference_kv_quant
    modules = (reference_ops.__name__, "folio.reference_kv_quant")
    public = {name for name, fn in vars(reference_ops).items()
              if inspect.isfunction(fn) and fn.__module__ in modules and not name.startswith("_")}
    assert public == {s.name for s in OPS if s.has_reference_op}


def test_ops_without_reference_name_where_it_is() -> None:
    for spec in OPS:
        if not spec.has_reference_op:
            assert not hasattr(reference_ops, spec.name), spec.name
            assert spec.reference in (op_registry.SAMPLING_REFERENCE, op_registry.SYNC_REFERENCE), spec.name
            if spec.reference == op_registry.SAMPLING_REFERENCE:
                assert callable(getattr(native_reference, f"{spec.name}_reference")), spec.name


# --- the dispatch ---


def test_op_set_has_one_method_per_op_with_the_registry_signature() -> None:
    op_set = ops.OpSet()
    for spec in OPS:
        method = getattr(op_set, spec.name)
        params = inspect.signature(method).parameters.values()
        got = tuple((p.name, _NO_DEFAULT if p.default is inspect.Parameter.empty else p.default) for p in params)
        assert got == registry_signature(spec, "cpu")[0], spec.name


# --- the bindings' one def list ---


def parse_signatures_header(text: str) -> dict[str, tuple[str, tuple, tuple]]:
    """{name: (modules, args, launch options)} of every OP(...) entry of FOLIO_NATIVE_OPS in op_signatures.h."""
    body = text.split("#define FOLIO_NATIVE_OPS(OP)", 1)[1]
    body = body.split("// clang-format on", 1)[0].replace("\\\n", " ")
    launch_defs = dict(re.findall(r"#define FOLIO_LAUNCH_ARGS_(\w+) (.*)", text))
    entries = {}
    for entry in _balanced_calls(body, "OP"):
        name, modules, launch, rest = (part.strip() for part in entry.split(",", 3))
        assert name not in entries, f"{name} listed twice in op_signatures.h"
        entries[name] = (modules, _py_args(rest), _launch_args(launch, launch_defs))
    return entries


def _balanced_calls(text: str, callee: str) -> list[str]:
    """The argument text of every `callee(...)` in text (nested parentheses kept)."""
    out, start = [], 0
    while (i := text.find(callee + "(", start)) >= 0:
        depth, j = 0, i + len(callee)
        while True:
            depth += {"(": 1, ")": -1}.get(text[j], 0)
            if depth == 0:
                break
            j += 1
        out.append(text[i + len(callee) + 1 : j])
        start = j
    return out


def _py_args(text: str) -> tuple:
    found = re.findall(r'py::arg\("(\w+)"\)(?:\s*=\s*([\w:()]+))?', text)
    return tuple((name, CPP_DEFAULTS[default] if default else _NO_DEFAULT) for name, default in found)


def _launch_args(launch: str, launch_defs: dict[str, str]) -> tuple:
    """The launch options a FOLIO_LAUNCH_ARGS_<launch> macro expands to (following one level of nesting)."""
    if launch == "NONE":
        return ()
    text = launch_defs[launch]
    for other, expansion in launch_defs.items():
        text = text.replace(f"FOLIO_LAUNCH_ARGS_{other}", expansion)
    assert text.startswith("py::kw_only(), "), f"launch options of {launch} must be keyword-only"
    return _py_args(text)


HEADER = parse_signatures_header(SIGNATURES_H.read_text())


def test_header_lists_exactly_the_registry_ops() -> None:
    assert set(HEADER) == {spec.name for spec in OPS}


@pytest.mark.parametrize("spec", OPS, ids=lambda s: s.name)
def test_header_matches_registry(spec) -> None:
    modules, args, launch = HEADER[spec.name]
    assert modules == ("BOTH" if spec.native == {"cpu", "cuda"} else "CUDA_ONLY")
    assert spec.native >= {"cuda"}, "the CUDA module defines every op of the list"
    assert (args, launch) == registry_signature(spec, "cuda")


def test_bindings_define_ops_only_through_the_list() -> None:
    for device_type, path in BINDING_FILES.items():
        text = path.read_text()
        assert '#include "op_signatures.h"' in text, path
        assert f"FOLIO_NATIVE_OPS(FOLIO_DEF_{device_type.upper()})" in text, path
        assert "m.def(" not in text, f"{path.name} defines an op outside op_signatures.h"


# --- the built modules ---


def module_signatures(module) -> dict[str, tuple[tuple, tuple]]:
    """{function name: (args, keyword-only args)} from pybind11's docstrings, e.g.
    `rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: typing.SupportsFloat) -> torch.Tensor`. Classes (the
    router's KeyIndex) are not ops."""
    out = {}
    for name in dir(module):
        fn = getattr(module, name)
        if name.startswith("_") or not callable(fn) or isinstance(fn, type):
            continue
        first_line = fn.__doc__.splitlines()[0]
        match = re.fullmatch(rf"{name}\((.*)\) -> .*", first_line)
        assert match, f"{name}: unexpected pybind docstring {first_line!r}"
        args, keyword_only = [], []
        target = args
        for param in _split_top_level(match.group(1)):
            if param == "*":
                target = keyword_only
                continue
            head, _, default = param.partition(" = ")
            value = _NO_DEFAULT if not default else {"None": None, "False": False, "True": True}[default]
            target.append((head.split(":")[0].strip(), value))
        out[name] = (tuple(args), tuple(keyword_only))
    return out


def _split_top_level(text: str) -> list[str]:
    parts, depth, current = [], 0, ""
    for ch in text:
        depth += {"[": 1, "(": 1, "]": -1, ")": -1}.get(ch, 0)
        if ch == "," and depth == 0:
            parts.append(current.strip())
            current = ""
        else:
            current += ch
    return parts + [current.strip()] if current.strip() else parts


def check_built_module(device_type: str) -> None:
    module = importlib.import_module(op_registry.NATIVE_MODULES[device_type])
    exported = module_signatures(module)
    expected = {spec.name: registry_signature(spec, device_type) for spec in OPS if device_type in spec.native}
    assert set(exported) == set(expected), "ops in the module but not the registry, or the reverse"
    for name, signature in expected.items():
        assert exported[name] == signature, name


@pytest.mark.skipif(_import_native("folio._native_cpu") is None, reason="folio._native_cpu is not built")
def test_built_cpu_module_matches_registry() -> None:
    check_built_module("cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_built_cuda_module_matches_registry() -> None:
    assert _import_native("folio._native_cuda") is not None, "folio._native_cuda is not built on a CUDA machine"
    check_built_module("cuda")
