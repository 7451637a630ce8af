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

__all__ = ["__version__", "TokenizeConfig", "PackConfig", "Mixture", "PacktoolError", "tokenize_dataset", "pack_dataset",
           "compute_stats"]

# Everything loads on first use: the stages pull in numba (through the packer), so that
# ``import packtool.reader`` on a training node stays light; the configs pull in numpy, so that
# the command line's entry point (packtool.launcher, run after this package is imported) takes
# Ctrl-C over before any heavy import starts.
_LAZY = {"tokenize_dataset": "pipeline", "pack_dataset": "pipeline", "compute_stats": "stats", "Mixture": "mixture",
         "TokenizeConfig": "config", "PackConfig": "config", "PacktoolError": "errors"}

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (a few ms)
if TYPE_CHECKING:
    from .config import PackConfig, TokenizeConfig
    from .errors import PacktoolError
    from .mixture import Mixture
    from .pipeline import pack_dataset, tokenize_dataset
    from .stats import compute_stats


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
