"""verl's knowledge is in one adapter package, ``skipinject/verl/``: every other module of the core names none of
verl's types, tensors, config trees, layout or version, but those in :data:`ALLOWED`, each for a stated reason."""

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


#: The modules outside the adapter that name some of verl's knowledge, what they name, and why.
ALLOWED = {
    # the public API re-exports the adapter's version check, for plugins declaring targets
    "__init__.py": {"verl_version", "version_matches"},
    # the engine patches a target only for the verl versions it declares
    "engine/__init__.py": {"verl_version", "version_matches"},
    # ``skipinject targets`` lists which targets this verl version takes
    "listing.py": {"verl_version", "version_matches"},
    # the never-called watch reports only targets of this verl version
    "report/silence.py": {"verl_version", "version_matches"},
    # skip.* settings are Hydra overrides: OmegaConf's grammar and validation (verl's config library, not verl)
    "config/overrides.py": {"omegaconf", "OmegaConf"},
    "config/schema.py": {"omegaconf", "OmegaConf"},
    # the missing-dependency hint names the package to install
    "invocation.py": {"omegaconf"},
    # phases hand a DataProto batch's meta_info to the role's phase hooks (the batch is otherwise opaque)
    "engine/phases.py": {"meta_info"},
    # a call's batch: its meta_info, looked up by name for the roles' step key
    "roles.py": {"meta_info"},
    # the miss explainer names the layout the run caches under and records the run settings from its config
    "report/misses.py": {"omegaconf", "OmegaConf", "layout_name"},
    # plugins' test kit builds verl batches and configs for their tests
    "testing.py": {"DataProto", "OmegaConf", "TensorDict", "attention_mask", "input_ids", "meta_info",
                   "non_tensor_batch", "omegaconf"},
}  # fmt: skip
CORE = sorted(str(p.relative_to(ROOT)) for p in ROOT.rglob("*.py") if p.relative_to(ROOT).parts[0] != "verl")


@pytest.mark.unit
@pytest.mark.parametrize("module", CORE)
def test_module_leaves_verl_to_the_adapter(module: str) -> None:
    assert code_names(ROOT / module) & VERL_NAMES <= ALLOWED.get(module, set())


def test_every_allowance_is_still_needed() -> None:
    stale = {module: names - code_names(ROOT / module) for module, names in ALLOWED.items()}
    assert {module: names for module, names in stale.items() if names} == {}
