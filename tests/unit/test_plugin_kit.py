"""The plugin kit (plugin API 1.1): codec headers, per-row digests, verl ranges.

Row digests are stored in every cache's ``meta.json`` (a hit whose inputs differ is reported), so
they must stay what the built-in roles computed before the kit: blake2b-64 over the pieces' bytes.
"""

from __future__ import annotations

import hashlib
import json

import pytest

import skipinject
from skipinject import CodecError, CodecHeader, attended_tokens, installed_verl_matches, row_digest, row_text

torch = pytest.importorskip("torch")


class Tensors(dict):
    """The ``keys()`` of a TensorDict (which refuses ``in`` on itself)."""


def test_codec_header_is_written_and_checked() -> None:
    header = CodecHeader("my_codec", 2)
    assert header.fields() == {"codec": "my_codec", "codec_version": 2}
    header.check({"codec": "my_codec", "codec_version": 2, "data": 1})
    with pytest.raises(CodecError, match=r"codec 'other' version 2, expected 'my_codec' version 2"):
        header.check({"codec": "other", "codec_version": 2})
    with pytest.raises(CodecError, match="version 1, expected 'my_codec' version 2"):
        header.check({"codec": "my_codec", "codec_version": 1})
    with pytest.raises(CodecError, match="codec None"):
        header.check({})


def test_row_digest_is_blake2b_64_over_the_pieces_bytes() -> None:
    ids = torch.tensor([5, 6, 7])
    values = torch.tensor([0.5, 1.5], dtype=torch.bfloat16)
    expected = hashlib.blake2b(digest_size=8)
    expected.update(b"settings")
    expected.update(b"3")
    expected.update(ids.numpy().tobytes())
    expected.update(values.view(torch.int16).numpy().tobytes())
    expected.update(json.dumps({"b": 1, "a": [1, 2]}, sort_keys=True).encode())
    assert row_digest(b"settings", "3", ids, values, {"b": 1, "a": [1, 2]}) == expected.hexdigest()
    assert row_digest(row_text("a")) != row_digest("a"), "a string value is digested as its JSON text"
    assert len(row_digest()) == 16


def test_attended_tokens_leave_padding_out() -> None:
    ids = torch.tensor([[1, 2, 3], [4, 5, 6]])
    mask = torch.tensor([[0, 1, 1], [1, 1, 1]])
    rows = attended_tokens(Tensors(input_ids=ids, attention_mask=mask))
    assert rows is not None and [r.tolist() for r in rows] == [[2, 3], [4, 5, 6]]
    assert [r.tolist() for r in attended_tokens(Tensors(input_ids=ids)) or []] == [[1, 2, 3], [4, 5, 6]]
    assert attended_tokens(Tensors(responses=ids)) is None and attended_tokens(None) is None


def test_installed_verl_ranges(monkeypatch: pytest.MonkeyPatch) -> None:
    from skipinject.verl import compat

    monkeypatch.setattr(compat, "verl_version", lambda: "0.10.0.dev0")
    assert installed_verl_matches(">=0.9") and not installed_verl_matches("<0.9")
    monkeypatch.setattr(compat, "verl_version", lambda: None)
    assert installed_verl_matches("<0.5"), "no verl: a plugin's clocks are kept"


def test_the_kit_is_part_of_the_plugin_api_1_1() -> None:
    assert skipinject.API_VERSION == (1, 6)
    for name in ("CodecHeader", "row_digest", "attended_tokens", "installed_verl_matches", "Loaded", "Plan"):
        assert name in skipinject.__all__
