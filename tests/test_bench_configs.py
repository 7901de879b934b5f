"""bench_configs --profile-now: each model is profiled, and its path, right before it is served (no processes)."""
from __future__ import annotations

import importlib
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest


def test_profile_now_profiles_then_plans_each_model_from_its_fresh_profile(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # The benchmark quiets the processes it starts by setting PACKRAT_LOG_LEVEL when imported: kept to this test.
    monkeypatch.setenv("PACKRAT_LOG_LEVEL", os.environ.get("PACKRAT_LOG_LEVEL", "INFO"))
    bench = importlib.import_module("benchmarks.bench_configs")
    commands: list[list[str]] = []

    def run(cmd: list[str], **kwargs: Any) -> subprocess.CompletedProcess[bytes]:
        commands.append(cmd)
        assert kwargs.get("check") is True  # a failed profile stops the benchmark, never plans from nothing
        if cmd[3:5] == ["profile", "run"]:
            shutil.copy("profiles/minilm.json", cmd[cmd.index("-o") + 1])
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(bench.subprocess, "run", run)
    path = bench.profile_now("redis://127.0.0.1:1/0", "minilm", tmp_path / "now", [1, 2, 4])
    assert path == tmp_path / "now" / "minilm.json" and path.is_file()
    profile_cmd, path_cmd = commands
    assert profile_cmd[3:] == ["profile", "run", "--model", "minilm", "--fresh", "--batches", "1,2,4", "-o", str(path)]
    assert path_cmd[3:7] == ["profile", "path", "--model", "minilm"]
    assert path_cmd[path_cmd.index("--profile") + 1] == str(path)
    assert path_cmd[path_cmd.index("--max-batch") + 1] == "4"
    assert path_cmd[path_cmd.index("--redis-url") + 1] == "redis://127.0.0.1:1/0"
    # More `profile run` arguments go at the end (--profile-args).
    bench.profile_now("redis://127.0.0.1:1/0", "minilm", tmp_path / "again", [1, 2], ["--passes", "3"])
    assert commands[-2][-2:] == ["--passes", "3"]
    # The results say which profile, and from when.
    used = bench.profiles_used(["minilm"], {"minilm": path})["minilm"]
    assert used["path"] == str(path) and used["profiled"] is not None
