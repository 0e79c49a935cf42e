"""skipinject role ``reward``: an example of a third-party role, installed as its own distribution."""
