"""The package version, alone in its module so that any layer can read it without importing
the package root (which imports the API and everything below it)."""

__version__ = "0.2.0"
