"""skipinject role ``rollout_tq`` for verl's V1 TransferQueue trainer, shipped as a plugin like third-party ones."""
