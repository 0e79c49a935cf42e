__version__ = "0.1.0"

#: The plugin API this skipinject provides (major, minor); its history is in docs/plugins.md. A plugin may
#: declare ``SKIPINJECT_API = 1`` or ``"1.1"``: same major and a minor no newer is compatible.
API_VERSION = (1, 6)
