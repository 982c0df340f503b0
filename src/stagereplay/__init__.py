"""stagereplay: audits stage replay in reasoning language models.

The Snakemake workflow is the pipeline; the library API (:mod:`stagereplay.api`) runs the same recipe on a model
and tokenizer one already has: ``replay``, ``transplant``, ``generate_stage`` and their result classes. As in
lm-evaluation-harness, they are imported the first time one is used, so ``import stagereplay`` imports no torch or
transformers (the workflow's jobs that load no model stay light).
"""

from stagereplay.version import __version__

_API = ("replay", "transplant", "generate_stage", "Replay", "ReplayBatch", "Continuation", "Transplant",
        "StageNotGeneratedError")
__all__ = ["__version__", *_API]


def __getattr__(name: str):
    if name in _API:
        from stagereplay import api

        return getattr(api, name)
    raise AttributeError(f"module 'stagereplay' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_API))
