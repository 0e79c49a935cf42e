"""Built-in rollout roles of skipinject, shipped as plugins exactly like third-party ones."""
