"""``cache show``/``diff`` load a tokenizer from the model directory a cache records only when the store would trust
that directory and its tokenizer files are of a tokenizer's size: a forged cache naming a directory with a sparse
1 GiB ``tokenizer.json`` (or one others can write) costs one warning line, never a read of it."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import pytest

from skipinject.cache_tool import fields
from skipinject.cache_tool.common import CommandError

transformers = pytest.importorskip("transformers")


@pytest.fixture
def loads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every directory a tokenizer is loaded from (the load itself replaced: only whether it happens counts)."""
    called: list[str] = []

    class Fake:
        def decode(self, ids: Any, skip_special_tokens: bool = True) -> str:
            return " ".join(map(str, ids))

    def from_pretrained(name: str, **kwargs: Any) -> Fake:
        called.append(name)
        return Fake()

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", from_pretrained)
    return called


def model_dir(tmp_path: Path, tokenizer_bytes: int = 100, mode: int = 0o755, name: str = "model") -> Path:
    directory = tmp_path / name
    directory.mkdir()
    with open(directory / "tokenizer.json", "wb") as handle:
        handle.truncate(tokenizer_bytes)  # sparse: no disk spent on it
    (directory / "tokenizer_config.json").write_text("{}")
    directory.chmod(mode)
    return directory


@pytest.mark.parametrize(
    ("make", "why"),
    [
        (lambda tmp: model_dir(tmp, tokenizer_bytes=1 << 30), "bytes, more than the"),
        (lambda tmp: model_dir(tmp, mode=0o777), "writable by group and others"),
    ],
    ids=["sparse-1GiB-tokenizer.json", "world-writable-directory"],
)
def test_a_recorded_model_directory_the_store_would_not_trust_is_one_line_and_never_read(
    tmp_path: Path, loads: list[str], caplog: pytest.LogCaptureFixture, make: Any, why: str
) -> None:
    good = model_dir(tmp_path, name="good")  # a directory of a tokenizer's files is used
    decode, source = fields.tokenizer(None, {"model": str(good)})
    assert decode is not None and source == str(good) and loads == [str(good)]
    loads.clear()
    directory = make(tmp_path)
    with caplog.at_level(logging.WARNING, logger="skipinject"):
        assert fields.tokenizer(None, {"model": str(directory)}) == (None, None)
    assert loads == []
    (record,) = caplog.records
    assert "not used" in record.getMessage() and why in record.getMessage() and "token ids" in record.getMessage()


def test_a_fifo_named_tokenizer_json_is_not_opened(tmp_path: Path, loads: list[str]) -> None:
    directory = model_dir(tmp_path)
    (directory / "tokenizer.json").unlink()
    os.mkfifo(directory / "tokenizer.json")
    assert fields.tokenizer(None, {"model": str(directory)}) == (None, None) and loads == []


def test_tokenizer_argument_past_the_bound_is_an_error(tmp_path: Path, loads: list[str]) -> None:
    directory = model_dir(tmp_path, tokenizer_bytes=1 << 30)
    with pytest.raises(CommandError, match="bytes, more than the"):
        fields.tokenizer(str(directory), {})
    assert loads == []
