"""TorchServe's model store for one batch setting: the zoo's TorchScript file, the handler, the batch settings.

``torch-model-archiver`` (from the peers environment) packs
``benchmarks/peers/ts_handler.py``, the TorchScript file written by
``benchmarks.peers.export`` (run in the project's environment, so the model is
the one ``packrat-mq up --graph torchscript`` traces), the class names written beside it
(``index_to_name.json``) and a ``model-config.yaml`` with the
batch settings: ``batchSize`` is B, ``maxBatchDelay`` the batch wait, and one
worker (``minWorkers = maxWorkers = 1``). The archive is a directory
(``--archive-format no-archive``): TorchServe loads it as it is, instead of
unzipping 100 MB into a temporary directory at every start.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

HANDLER = Path(__file__).resolve().parent / "ts_handler.py"
ROOT = Path(__file__).resolve().parent.parent.parent
#: Written by benchmarks.peers.export beside the TorchScript file (not imported: export needs torch).
CATEGORIES = "index_to_name.json"


def model_config(batch: int, wait_ms: float, response_timeout_s: int = 120) -> str:
    return (f"minWorkers: 1\nmaxWorkers: 1\nbatchSize: {batch}\nmaxBatchDelay: {int(round(wait_ms))}\n"
            f"responseTimeout: {response_timeout_s}\n")


def build_store(venv: Path, workdir: Path, *, model: str, batch: int, wait_ms: float, seed: int = 0) -> Path:
    """A model store holding ``model`` traced at ``batch``, served with B=``batch`` and a ``wait_ms`` batch wait."""
    store = workdir / f"store-b{batch}-w{wait_ms:g}"
    if (store / model / "MAR-INF" / "MANIFEST.json").exists():
        return store
    workdir.mkdir(parents=True, exist_ok=True)
    serialized = workdir / f"{model}-b{batch}.pt"
    if not serialized.exists() or not (workdir / CATEGORIES).exists():
        subprocess.run([sys.executable, "-W", "ignore", "-m", "benchmarks.peers.export", "--model", model,
                        "--batch", str(batch), "--seed", str(seed), "--out", str(serialized)],
                       cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    config = workdir / f"model-config-b{batch}-w{wait_ms:g}.yaml"
    config.write_text(model_config(batch, wait_ms))
    store.mkdir(parents=True, exist_ok=True)
    subprocess.run([str(venv / "bin" / "torch-model-archiver"), "--model-name", model, "--version", "1.0",
                    "--serialized-file", str(serialized), "--handler", str(HANDLER), "--config-file", str(config),
                    "--extra-files", str(workdir / CATEGORIES),
                    "--export-path", str(store), "--archive-format", "no-archive", "--force"],
                   check=True, stdout=subprocess.DEVNULL)
    return store
