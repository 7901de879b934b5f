"""What `up` and `pool` decide before starting anything: names, configuration, profile."""
from __future__ import annotations

from pathlib import Path

import click
import pytest

from optimizer.planning.profile import Profile, ProfileEntry
from packrat_mq.cli.serve import choose_configuration, model_and_handler


def test_model_and_handler() -> None:
    assert model_and_handler("resnet50", None) == ("resnet50", "resnet50")
    assert model_and_handler("mypkg.mod:MyHandler", None) == ("myhandler", "mypkg.mod:MyHandler")
    assert model_and_handler("mypkg.mod:MyHandler", "faces") == ("faces", "mypkg.mod:MyHandler")
    with pytest.raises(click.BadParameter, match="model name"):
        model_and_handler("echo", "bad name")


def _profile(tmp_path: Path) -> Path:
    points = {(1, 1): 10.0, (1, 2): 18.0, (2, 1): 9.0, (2, 2): 12.0}
    prof = Profile(model="toy", entries=tuple(ProfileEntry(threads=t, batch=b, mean_ms=ms) for (t, b), ms in points.items()))
    return prof.save(tmp_path / "toy.json")


def test_hand_given_instances_keep_the_profile_for_partial_batches(tmp_path: Path) -> None:
    path = _profile(tmp_path)
    config, used = choose_configuration("toy", "1x2,1x2", None, None, str(path))
    assert str(config) == "1x2,1x2" and used == str(path)
    config, used = choose_configuration("no-profile-model", "1x2", None, None, None)
    assert used is None
    with pytest.raises(click.BadParameter, match="no profile"):
        choose_configuration("toy", "1x2", None, None, str(tmp_path / "missing.json"))


def test_optimizer_chooses_from_the_profile(tmp_path: Path) -> None:
    path = _profile(tmp_path)
    config, used = choose_configuration("toy", None, 2, 4, str(path))
    assert config.batch == 4 and config.threads <= 2 and used == str(path)
    assert config.predicted_latency_ms == 18.0  # two 1-thread instances of 2 beat one 2-thread instance of 4 (unprofiled)


def test_without_a_profile_one_instance_takes_every_thread() -> None:
    config, used = choose_configuration("no-profile-model", None, 3, 6, None)
    assert str(config) == "3x6" and used is None


def test_infeasible_batch_is_a_clear_error(tmp_path: Path) -> None:
    path = _profile(tmp_path)
    with pytest.raises(click.ClickException, match="optimizer"):
        choose_configuration("toy", None, 1, 3, str(path))
