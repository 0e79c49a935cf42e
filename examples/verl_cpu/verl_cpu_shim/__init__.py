"""verl CPU shim: lets stock verl 0.9.1 train on a CPU-only host.

verl imports this package in every process that imports ``verl`` when
``VERL_USE_EXTERNAL_MODULES=verl_cpu_shim`` (and this directory's parent is on
``PYTHONPATH``). Importing it:

* registers the ``cpu`` platform (selected by ``VERL_PLATFORM=cpu``);
* makes verl's Ray process-group init use plain gloo;
* registers the ``hf`` rollout backend (``actor_rollout_ref.rollout.name=hf``);
* registers the ``cpu_store`` checkpoint engine
  (``actor_rollout_ref.rollout.checkpoint_engine.backend=cpu_store``) for the
  asynchronous trainers, whose rollout runs in other processes.

Importing it twice is harmless.
"""

from __future__ import annotations

from ._install import install

__all__ = ["install"]

install()
