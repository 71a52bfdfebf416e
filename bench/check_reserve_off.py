"""One-off check (bench/RESULTS.md): tests/test_replica_engine_gpu.py's test with the activation reserve turned off
must fail, else the test cannot tell the reserve's work apart from luck."""
import sys
import tempfile
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parents[1] / "tests")]

from test_replica_engine_gpu import test_a_cache_of_all_free_memory_still_runs_full_chunks as check  # noqa: E402

import folio.serve.engine  # noqa: E402
from folio.demo import write_demo_model  # noqa: E402

folio.serve.engine.activation_reserve_bytes = lambda *args: 0
with tempfile.TemporaryDirectory() as d:
    write_demo_model(Path(d))
    try:
        check(Path(d))
    except Exception as e:  # noqa: BLE001 -- any failure is what this check wants to see
        print(f"reserve off: the test fails, as it should ({type(e).__name__}: {str(e)[:160]})")
    else:
        print("reserve off: the test PASSES -- it does not detect a missing reserve")
        sys.exit(1)
