"""The package version, on the lowest floor so that any module (the CLI's ``--version``) can read it
without importing the package root."""

__version__ = "0.1.0"
