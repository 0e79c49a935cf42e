"""Everything skipinject knows about verl (docs/architecture.md): the rest knows roles, steps, payloads and bytes."""
