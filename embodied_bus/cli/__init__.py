"""The ``embodied-bus`` command line: thin surfaces over the library."""

__all__: list[str] = []
