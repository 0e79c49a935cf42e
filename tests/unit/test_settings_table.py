"""Each role setting declared once (issue 21): RoleConfig's fields drive the OmegaConf schema, the
transport and the runner's help; the README's configuration table lists each key with its default."""

from __future__ import annotations

import re
from dataclasses import fields

import pytest

from skipinject.cli import build_parser
from skipinject.config import Config, RoleConfig, role_config
from skipinject.config.schema import ROLE_KEYS, choices, role_schema
from tests.conftest import ROOT


@pytest.mark.parametrize("page", ["README.md", "docs/runner.md"])
def test_the_configuration_tables_list_every_key_and_its_default(page: str) -> None:
    """The README's short table and docs/runner.md's full one."""
    text = (ROOT / page).read_text()
    table = text.split("| key | default | meaning |\n|---|---|---|\n", 1)[1].split("\n\n", 1)[0]
    rows = [re.fullmatch(r"\| `(\w+)` \| `([^`]*)` \| .+ \|", line) for line in table.splitlines()]
    assert all(rows), table
    defaults = {f.name: str(getattr(RoleConfig(), f.name)) for f in fields(RoleConfig)}
    defaults["steps"] = RoleConfig().steps.format()
    assert [(row[1], row[2]) for row in rows if row] == list(defaults.items())


def test_the_runners_help_names_every_key_and_its_choices() -> None:
    helped = " ".join(build_parser().format_help().split("keys:", 1)[1].split())
    for key in ROLE_KEYS:
        assert re.search(rf"\b{key}\b", helped), key
        for choice in choices(key):
            assert choice in helped
    assert "trust_dir_permissions" in helped


def test_the_schema_has_the_configs_keys_and_defaults() -> None:
    from omegaconf import OmegaConf

    assert [f.name for f in fields(role_schema())] == [f.name for f in fields(RoleConfig)] == list(ROLE_KEYS)
    defaults = OmegaConf.to_container(OmegaConf.structured(role_schema()))
    assert role_config("r", defaults) == RoleConfig()


def test_every_key_travels_to_child_processes() -> None:
    changed = role_config(
        "r",
        {
            "enable": True,
            "dump_dir": "/data/skip",
            "steps": "1-3,7",
            "action": "strict",
            "trust_upstream": True,
            "on_mismatch": "fail",
            "trust_dir_permissions": True,
            "compression": "zstd-9",
            "reuse_hit_memory": 0,
            "read_ahead": False,
            "rescore": "never",
            "save": False,
            "defer_weight_sync": "never",
        },
    )
    assert {f.name for f in fields(changed) if getattr(changed, f.name) != getattr(RoleConfig(), f.name)} == set(
        ROLE_KEYS
    )
    back = Config.from_json(Config(roles={"r": changed}).to_json())
    assert back.role("r") == changed
