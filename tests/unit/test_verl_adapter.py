"""verl's knowledge is in one adapter package, ``skipinject/verl/``: the modules that match rows, show a
cached step's fields and help plugins ask it, and name none of verl's types, tensors or config trees."""

from __future__ import annotations

import io
import tokenize
from pathlib import Path

import pytest

import skipinject

#: What only verl's adapter may name in code: its config library, DataProto's and TensorDict's parts,
#: its tensor names, its directory layout and its version.
VERL_NAMES = {
    "omegaconf",
    "OmegaConf",
    "DataProto",
    "non_tensor_batch",
    "meta_info",
    "TensorDict",
    "NonTensorStack",
    "NonTensorData",
    "input_ids",
    "attention_mask",
    "layout_name",
    "verl_version",
    "version_matches",
}
ROOT = Path(skipinject.__file__).parent


def code_names(path: Path) -> set[str]:
    """Names and string literals of a module's code (docstrings and comments left out)."""
    found = set()
    tokens = list(tokenize.generate_tokens(io.StringIO(path.read_text()).readline))
    for index, token in enumerate(tokens):
        if token.type == tokenize.NAME:
            found.add(token.string)
        elif token.type == tokenize.STRING and tokens[index - 1].type not in (tokenize.INDENT, tokenize.NEWLINE):
            found.update(token.string.strip("\"'").split("."))
    return found


@pytest.mark.unit
@pytest.mark.parametrize("module", ["engine/matching.py", "cache_tool/fields.py", "plugin_kit.py"])
def test_module_leaves_verl_to_the_adapter(module: str) -> None:
    assert code_names(ROOT / module) & VERL_NAMES == set()
