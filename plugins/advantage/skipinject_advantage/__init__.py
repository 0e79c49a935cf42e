"""skipinject role ``advantage``: an example of a third-party role, installed as its own distribution."""
