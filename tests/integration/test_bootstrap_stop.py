"""``bootstrap.stop()`` undoes every patch ``start`` made, ``ray.init``'s included (issue 21).

Imports ray (no cluster is started)."""

from __future__ import annotations

from pathlib import Path

from skipinject import bootstrap
from skipinject.config import Config, RoleConfig
from skipinject.injector import INJECTOR
from skipinject.plugin_manager import load_plugins


def test_stop_restores_ray_init_and_a_second_start_patches_it_again(toy_path: Path, tmp_path: Path) -> None:
    import ray

    original = ray.init
    config = Config(roles={"toy": RoleConfig(enable=True, dump_dir=str(tmp_path))})
    bootstrap.start(config, load_plugins("skipinject_toy_plugin:plugin"))
    assert INJECTOR.is_patched(bootstrap.RAY_INIT) and ray.init is not original
    bootstrap.stop()
    assert not INJECTOR.is_patched(bootstrap.RAY_INIT) and ray.init is original
    bootstrap.start(config, load_plugins("skipinject_toy_plugin:plugin"))
    assert INJECTOR.is_patched(bootstrap.RAY_INIT)
    bootstrap.stop()
    assert ray.init is original
