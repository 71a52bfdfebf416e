"""Builds folio's native extensions against the torch that is already installed.

    pip install --no-build-isolation -e .        # or: python setup.py build_ext --inplace

Always builds folio._native_cpu; builds folio._native_cuda too when the installed torch has CUDA and nvcc is
found (CUDA_HOME or PATH). Build-time settings (read here only, never inside folio/):
    FOLIO_CUDA_ARCHS   compute capabilities, e.g. "9.0" for a fast Hopper-only build (default: sources.py)
    FOLIO_BUILD_CUDA   "0" skips the CUDA module even where it could be built
    MAX_JOBS           parallel compile jobs (default: every core)
"""

from __future__ import annotations

import os
import runpy
import sys
import tomllib
from pathlib import Path

from setuptools import find_namespace_packages, setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
SOURCES = runpy.run_path(str(ROOT / "native" / "sources.py"))


def _cuda_gencode_flags(archs: str) -> list[str]:
    """'8.0;9.0' -> -gencode flags with machine code for each, plus PTX of the newest for later chips."""
    caps = [a.strip().replace(".", "") for a in archs.replace(",", ";").split(";") if a.strip()]
    if not caps or not all(c.isdigit() for c in caps):
        raise SystemExit(f"FOLIO_CUDA_ARCHS={archs!r}: expected compute capabilities like '8.0;9.0'")
    flags = [f"-gencode=arch=compute_{c},code=sm_{c}" for c in caps]
    newest = max(caps, key=int)
    return flags + [f"-gencode=arch=compute_{newest},code=compute_{newest}"]


def _extensions() -> tuple[list, dict]:
    try:
        import torch
        from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension
    except ImportError:
        # Metadata-only runs (e.g. `pip install` without --no-build-isolation) get no native code; folio.ops
        # then falls back to the torch reference ops.
        print("setup.py: torch is not importable here; building no native extension", file=sys.stderr)
        return [], {}

    os.environ.setdefault("MAX_JOBS", str(os.cpu_count() or 1))
    cxx_flags = ["-O3"]
    extensions = [
        CppExtension(SOURCES["CPU_MODULE"], SOURCES["CPU_SOURCES"], extra_compile_args={"cxx": cxx_flags}),
    ]
    want_cuda = os.environ.get("FOLIO_BUILD_CUDA", "1") != "0"
    if want_cuda and torch.version.cuda is not None and CUDA_HOME is not None:
        archs = os.environ.get("FOLIO_CUDA_ARCHS", SOURCES["DEFAULT_CUDA_ARCHS"])
        nvcc_flags = ["-O3", "-lineinfo", *_cuda_gencode_flags(archs)]
        extensions.append(
            CUDAExtension(
                SOURCES["CUDA_MODULE"],
                SOURCES["CUDA_SOURCES"],
                extra_compile_args={"cxx": cxx_flags, "nvcc": nvcc_flags},
            )
        )
        print(f"setup.py: building {SOURCES['CUDA_MODULE']} for compute capabilities {archs}", file=sys.stderr)
    else:
        reason = "FOLIO_BUILD_CUDA=0" if not want_cuda else (
            "torch has no CUDA" if torch.version.cuda is None else "nvcc not found (set CUDA_HOME)")
        print(f"setup.py: skipping {SOURCES['CUDA_MODULE']}: {reason}", file=sys.stderr)
    return extensions, {"build_ext": BuildExtension.with_options(use_ninja=True)}


def _packages() -> list[str]:
    """The engine's packages as found under folio/, and every package of the directories that pyproject.toml's
    package-dir maps into folio's namespace (replicas/ -> folio.serve, ...) under its mapped name: no directory
    installs under its own top-level name. (pyproject.toml cannot list found and mapped packages together.)
    Namespace packages count, as they did for pyproject's packages.find: folio/data holds package data."""
    with open(ROOT / "pyproject.toml", "rb") as f:
        package_dir = tomllib.load(f)["tool"]["setuptools"]["package-dir"]
    packages = []
    for package, directory in [("folio", "folio"), *sorted(package_dir.items())]:
        packages += [package, *(f"{package}.{name}" for name in find_namespace_packages(str(ROOT / directory)))]
    return packages


class BuildPyWithProtos(build_py):
    """Generates the gRPC modules (protos/folio/v1/*_pb2*.py, never committed) into the build."""

    def run(self) -> None:
        try:
            import grpc_tools  # noqa: F401
        except ImportError:
            print("setup.py: grpcio-tools not installed; gRPC modules not generated (python -m folio.proto.compile)",
                  file=sys.stderr)
        else:
            compile_protos = runpy.run_path(str(ROOT / "protos" / "compile.py"))["compile_protos"]
            compile_protos(ROOT / "protos")
        super().run()


ext_modules, cmdclass = _extensions()
cmdclass["build_py"] = BuildPyWithProtos
setup(packages=_packages(), ext_modules=ext_modules, cmdclass=cmdclass)
