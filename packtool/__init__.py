"""packtool: offline, exact packing of vision-language training data.

Library entry points (the CLI is a thin shell over these)::

    import packtool
    summary = packtool.tokenize_dataset(["data.jsonl"], "tok/", packtool.TokenizeConfig(media_root="media"))
    summary = packtool.pack_dataset("tok/", "packed/", packtool.PackConfig(max_tokens=8192))
    mixture = packtool.Mixture.from_rates(["tok_a/", "tok_b/"], "1.0,2.5", seed=0)   # several sources
    summary = packtool.pack_dataset(mixture, "mixed/", packtool.PackConfig(max_tokens=8192))
    report = packtool.compute_stats("packed/")
"""

__version__ = "0.1.0"

from .config import PackConfig, TokenizeConfig  # noqa: E402
from .errors import PacktoolError  # noqa: E402

__all__ = ["__version__", "TokenizeConfig", "PackConfig", "Mixture", "PacktoolError", "tokenize_dataset", "pack_dataset",
           "compute_stats"]

# The stages pull in numba (through the packer); they load on first use so that
# ``import packtool.reader`` on a training node stays light.
_LAZY = {"tokenize_dataset": "pipeline", "pack_dataset": "pipeline", "compute_stats": "stats", "Mixture": "mixture"}


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'packtool' has no attribute {name!r}")
    from importlib import import_module

    value = getattr(import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
