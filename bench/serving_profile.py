"""Where the serving path spends its CPU: py-spy samples of the local cluster's Serve processes (gRPC proxy, ingress,
generator replicas) while a load runs, summed by function.

    with RayProfile(seconds=10, out_dir=...) as profile:   # starts py-spy on every Serve process found
        ... run the load ...
    print(profile.report())                                # per process: CPU share, top functions (self and total)

Processes are found by Ray's process titles ("ray::ProxyActor", "ray::ServeReplica:<app>:<deployment>"). py-spy
must be on PATH (or beside this Python) and may attach to them (root, or ptrace allowed); without it the report
says so and nothing else changes. Samples are py-spy's collapsed stacks (--format raw), idle threads left out, so a
process's sample count over its duration is the CPU it used in Python and native code under it.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

SAMPLE_RATE_HZ = 200
_FRAME = re.compile(r"^(.*) \((.*):(\d+)\)$")
ROLES = (("ray::ProxyActor", "proxy"), ("ray::ServeReplica", "replica"))


def py_spy() -> str | None:
    return shutil.which("py-spy") or shutil.which("py-spy", path=str(Path(sys.executable).parent))


def serve_processes() -> dict[int, str]:
    """pid -> a name (proxy / the deployment's name, with the pid) of every Serve process on this machine."""
    import psutil

    found = {}
    for proc in psutil.process_iter(["pid", "cmdline"]):
        title = " ".join(proc.info["cmdline"] or ())
        for prefix, role in ROLES:
            if title.startswith(prefix):
                name = title.split()[0].split(":")[-1] if role == "replica" else role
                found[proc.info["pid"]] = f"{name}-{proc.info['pid']}"
    return found


def _frame(text: str) -> str:
    """py-spy's "function (path/to/file.py:123)" as "function file.py:123"."""
    match = _FRAME.match(text)
    return f"{match[1]} {match[2].rsplit('/', 1)[-1]}:{match[3]}" if match else text


def stack_totals(text: str) -> tuple[int, Counter, Counter]:
    """Samples, samples per function where it was running (self), samples per function anywhere on the stack."""
    samples, own, anywhere = 0, Counter(), Counter()
    for line in text.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        frames = [_frame(f) for f in stack.split(";")]
        samples += n
        own[frames[-1]] += n
        for frame in set(frames):
            if not frame.startswith(("process ", "thread ")):  # (py-spy's first "frames" name them)
                anywhere[frame] += n
    return samples, own, anywhere


class RayProfile:
    def __init__(self, seconds: float, out_dir: str | Path) -> None:
        self.seconds, self.out_dir = seconds, Path(out_dir)
        self.runs: list[tuple[str, Path, subprocess.Popen]] = []
        self.missing: str | None = None

    def __enter__(self) -> RayProfile:
        exe = py_spy()
        if exe is None:
            self.missing = "py-spy not found: no profile"
            return self
        self.out_dir.mkdir(parents=True, exist_ok=True)
        for pid, name in sorted(serve_processes().items()):
            path = self.out_dir / f"{name}.txt"
            cmd = [exe, "record", "--pid", str(pid), "--duration", str(int(self.seconds)), "--rate",
                   str(SAMPLE_RATE_HZ), "--format", "raw", "--nonblocking", "--output", str(path)]
            self.runs.append((name, path, subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)))
        return self

    def __exit__(self, *exc) -> None:
        for _, _, proc in self.runs:
            try:
                proc.wait(timeout=self.seconds + 30)
            except subprocess.TimeoutExpired:
                proc.kill()

    def report(self, top: int = 8) -> str:
        if self.missing:
            return self.missing
        lines = []
        for name, path, proc in self.runs:
            if not path.exists():
                err = proc.stderr.read().decode(errors="replace").strip().splitlines() if proc.stderr else []
                lines.append(f"{name}: no samples ({err[-1] if err else 'py-spy wrote nothing'})")
                continue
            samples, own, anywhere = stack_totals(path.read_text())
            cpu = samples / (SAMPLE_RATE_HZ * self.seconds)
            lines.append(f"{name}: {samples} samples = {cpu:.2f} CPU cores busy over {self.seconds:g} s")
            for label, counter in (("self", own), ("total", anywhere)):
                for frame, n in counter.most_common(top):
                    lines.append(f"  {label} {n / max(samples, 1):6.1%}  {frame}")
        return "\n".join(lines)
