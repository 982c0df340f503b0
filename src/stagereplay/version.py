"""The package's version, which its records carry (provenance, the report); pyproject.toml holds the same."""

__version__ = "0.1.0"
