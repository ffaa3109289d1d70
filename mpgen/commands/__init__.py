"""The commands beside ``build``: each a library function the CLI calls."""
