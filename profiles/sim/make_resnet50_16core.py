"""Make ``resnet50-16core.csv`` and ``.json``: a *modelled* 16-core ResNet-50 profile, not a measurement.

No 16-core machine was available, so this writes what Amdahl's law predicts
from what this repository did measure (``profiles/resnet50.json``, 2 cores):

    L[t, b] = L1(b) * (s + (1 - s) / t),   t = 1..16, b = 1, 2, 4, ..., 64

- ``L1(b)``: the measured 1-thread latency at b = 1..32; b = 64 is twice b = 32
  (the profile's largest batch, scaled linearly, as the ``profiled`` model does).
- ``s``: the serial fraction, fitted to the measured 2-thread rows:
  ``L[2, b] / L[1, b] = (1 + s) / 2`` gives ``s_b = 2 L[2, b] / L[1, b] - 1``,
  and ``s`` is their mean over b, rounded to two places.

Not modelled: memory bandwidth and caches shared by instances, turbo clocks
that fall as more cores work, hyper-threads, a serial fraction that varies with
the batch. The shape (how latency falls with threads, grows with the batch) is
what the optimizer and the estimator need to be exercised on; its numbers are
no prediction for a real 16-core server.

The CSV is imported with the real ``packrat-mq profile import``; then the
profile's ``machine`` is set to say what it is (``cpu_model`` starts with
"MODEL, not a measurement"), one socket of 16 cores.

Run from the repository root: ``python profiles/sim/make_resnet50_16core.py``.
"""
from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

from optimizer.planning.profile import MachineInfo, Profile

HERE = Path(__file__).resolve().parent
SOURCE = HERE.parent / "resnet50.json"
CSV = HERE / "resnet50-16core.csv"
JSON = HERE / "resnet50-16core.json"
CORES = 16
BATCHES = (1, 2, 4, 8, 16, 32, 64)


def main() -> int:
    measured = json.loads(SOURCE.read_text())
    row = {(e["threads"], e["batch"]): e["mean_ms"] for e in measured["entries"]}
    sizes = sorted(b for (t, b) in row if t == 1)
    fits = [2 * row[(2, b)] / row[(1, b)] - 1 for b in sizes if (2, b) in row]
    s = round(sum(fits) / len(fits), 2)
    largest = sizes[-1]

    def l1(b: int) -> float:
        return row[(1, b)] if b in sizes else row[(1, largest)] * b / largest

    with CSV.open("w", newline="") as f:
        out = csv.writer(f)
        out.writerow(["threads", "batch_size", "latency_ms"])
        for t in range(1, CORES + 1):
            for b in BATCHES:
                out.writerow([t, b, f"{l1(b) * (s + (1 - s) / t):.3f}"])
    subprocess.run([sys.executable, "-m", "packrat_mq", "profile", "import", str(CSV), "-o", str(JSON),
                    "--model", "resnet50", "--force"], check=True)
    prof = Profile.load(JSON)
    source_cpu = measured.get("machine", {}).get("cpu_model") or "unknown CPU"
    prof.machine = MachineInfo(
        cpu_model=(f"MODEL, not a measurement: Amdahl s={s:g} on resnet50's measured t=1 row "
                   f"({source_cpu}, 2 cores); see profiles/sim/README.md"),
        sockets=1, physical_cores=CORES, logical_cpus=CORES, hostname="synthetic",
    )
    prof.save(JSON)
    print(f"s = {s:g} (per batch size: {', '.join(f'{x:.3f}' for x in fits)}) -> {CSV.name}, {JSON.name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
