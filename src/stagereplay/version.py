"""The package's version, which its records carry (provenance, the report) and pyproject.toml reads."""

__version__ = "0.1.0"
