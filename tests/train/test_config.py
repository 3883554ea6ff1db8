"""Training settings: a refused value names where it came from (the file or variable)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from adcloud.train.config import TrainConfig
from adcloud.train.errors import TrainError


def test_a_bad_value_in_a_settings_file_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "my settings.yaml"
    path.write_text("train:\n  lr: -1\n  workers: 0\n  steps: 10\n")
    with pytest.raises(TrainError) as caught:
        TrainConfig.load(file=path, environ={})
    text = str(caught.value)
    assert f"workers must be >= 1, not 0 (from {path})" in text
    assert f"lr must be > 0 and finite, not -1.0 (from {path})" in text


def test_a_bad_variable_is_named_and_an_override_is_not_blamed_on_the_file(
    tmp_path: Path,
) -> None:
    path = tmp_path / "train.yaml"
    path.write_text("train:\n  workers: 0\n")
    with pytest.raises(TrainError) as caught:
        TrainConfig.load(file=path, environ={"ADCLOUD_TRAIN_LR": "-2"}, workers=0)
    text = str(caught.value)
    assert "lr must be > 0 and finite, not -2.0 (from ADCLOUD_TRAIN_LR)" in text
    assert "workers must be >= 1, not 0;" in text  # --set workers=0: the caller's own
    assert str(path) not in text


def test_bad_task_options_in_a_file_name_the_file(tmp_path: Path) -> None:
    path = tmp_path / "train.yaml"
    path.write_text('train:\n  task_options: "{bad"\n')
    where = re.escape(f"(from {path})")
    with pytest.raises(TrainError, match=rf"train.task_options: not a JSON object.*{where}"):
        TrainConfig.load(file=path, environ={})


def test_good_settings_load() -> None:
    config = TrainConfig.load(environ={"ADCLOUD_TRAIN_LR": "0.5"}, steps=3)
    assert (config.lr, config.steps) == (0.5, 3)
