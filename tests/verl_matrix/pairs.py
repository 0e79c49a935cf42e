"""Which older-verl pairs exist and which ``SKIPINJECT_VERL_MATRIX`` chooses (no verl imported here).

Its own module so that the unit tier can pin what CI runs by default (one older verl: the sync
worker-group pair of several calls per step, ``0.6.1-sync-dapo``) without importing the e2e harness.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

OLDER = ("0.9.0", "0.8.0", "0.7.1", "0.6.1", "0.5.0", "0.4.1")
#: Run by ``make test`` (and so in CI) unless SKIPINJECT_VERL_MATRIX says otherwise: versions or pair
#: ids. verl 0.6.1's DAPO recipe on the worker group proves the mechanisms verl 0.9.1's runs cannot (the
#: ``init_workers->actor_rollout_wg.generate_sequences`` target, several calls per step, an older verl).
DEFAULT_VERSIONS = ("0.6.1-sync-dapo",)


@dataclass(frozen=True)
class Pair:
    """One pair of runs: a verl version and its ``actor_rollout_ref.rollout.mode`` (None: the harness's)."""

    version: str
    rollout_mode: str | None = None
    #: Another trainer than main_ppo's GRPO (``dapo``: the recipe fixture; ``remax``): chosen by its id only.
    variant: str | None = None

    @property
    def id(self) -> str:
        return "-".join(part for part in (self.version, self.rollout_mode, self.variant) if part)

    @property
    def sync(self) -> bool:
        """Generation through the worker group (verl < 0.6 has only that path on CPU)."""
        major, minor = (int(part) for part in self.version.split(".")[:2])
        return self.rollout_mode == "sync" or (major, minor) < (0, 6)


#: verl 0.6.1 runs twice: through the agent loop (``mode=async``) and through the worker group.
PAIRS = (Pair("0.8.0"), Pair("0.7.1"), Pair("0.6.1"), Pair("0.6.1", "sync"), Pair("0.5.0"), Pair("0.4.1"))
#: Several generation calls per step on the worker-group path: DAPO's recipe loop, REMAX's baseline.
CALL_PAIRS = (
    Pair("0.6.1", "sync", "dapo"),
    Pair("0.5.0", variant="dapo"),
    Pair("0.6.1", "sync", "remax"),
    Pair("0.5.0", variant="remax"),
)
#: Pairs of the V1 TransferQueue trainer (verl 0.9.0: ``skip.rollout_tq`` in ``colocate_async``, whose
#: warm-up 0.9.0 submits in ``on_train_begin``), chosen by their version or id.
V1_PAIRS = (Pair("0.9.0"),)
#: Pairs verl itself cannot run, on any device: chosen, they skip with the reason instead of failing.
VERL_BUGS = {
    "0.5.0-remax": "verl 0.5.0's REMAX cannot run with rollout.n > 1 (a verl bug): RayPPOTrainer.fit deep-copies "
    "gen_batch, already repeated n times, as the greedy baseline's batch, so batch.union(gen_baseline_output) "
    "(4 prompts, 8 rows) fails verl's 'Two tensor dict must have identical batch size' assertion",
}


def selected_versions() -> tuple[str, ...]:
    """Versions and pair ids chosen by SKIPINJECT_VERL_MATRIX."""
    wanted = os.environ.get("SKIPINJECT_VERL_MATRIX", "").strip()
    if not wanted:
        return DEFAULT_VERSIONS
    if wanted == "all":
        return OLDER + tuple(pair.id for pair in CALL_PAIRS)
    if wanted == "none":
        return ()
    return tuple(v.strip() for v in wanted.split(",") if v.strip())


def skip_reason(pair: Pair, chosen: tuple[str, ...]) -> str | None:
    """Why ``pair`` does not run (not chosen, or a verl bug stops it), or None: it runs."""
    if not is_chosen(pair, chosen):
        return f"verl {pair.id} not in SKIPINJECT_VERL_MATRIX"
    return VERL_BUGS.get(pair.id)


def is_chosen(pair: Pair, chosen: tuple[str, ...]) -> bool:
    """A pair runs when its id is chosen, or its version is and it is no variant (those cost extra)."""
    return pair.id in chosen or (pair.version in chosen and pair.variant is None)
