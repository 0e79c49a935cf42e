"""Checks shared by the remote-store tests (fsspec's memory store, and a real S3 server)."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from skipinject import bootstrap
from skipinject.config import Config, RoleConfig
from skipinject.plugin_manager import load_plugins


def start(dump_dir: str, **settings: Any) -> Any:
    cfg = RoleConfig(enable=True, dump_dir=dump_dir, **settings)
    return bootstrap.start(Config(roles={"toy": cfg}), load_plugins("skipinject_toy_plugin:plugin"))


def generate(toy: Any, steps: tuple[int, ...]) -> list[Any]:
    trainer = toy.Trainer()
    out = []
    for step in steps:
        trainer.global_steps = step
        out.append(trainer.generate([step]))
    return out


def check_engine_round_trip(toy: Any, url: str, caplog: pytest.LogCaptureFixture) -> list[Any]:
    """A run caches steps 1 and 2 under ``url``; the next run serves both without calling the target."""
    start(url, steps=(1, 2))
    first = generate(toy, (1, 2))
    bootstrap.stop()
    start(url, steps=(1, 2))
    toy.CALLS.clear()
    with caplog.at_level(logging.INFO, logger="skipinject"):
        second = generate(toy, (1, 2))
    assert toy.CALLS == [] and second == first
    hits = [r.getMessage() for r in caplog.records if "hit, served step" in r.getMessage()]
    assert len(hits) == 2 and all(url.split("://", 1)[1] in m for m in hits), hits
    bootstrap.stop()
    return first
