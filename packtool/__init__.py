"""packtool: offline, exact packing of vision-language training data.

Library entry points (the CLI is a thin shell over these)::

    import packtool
    summary = packtool.tokenize_dataset(["data.jsonl"], "tok/", packtool.TokenizeConfig(media_root="media"))
    summary = packtool.pack_dataset("tok/", "packed/", packtool.PackConfig(max_tokens=8192))
    report = packtool.compute_stats("packed/")
"""

__version__ = "0.1.0"

from .config import PackConfig, TokenizeConfig  # noqa: E402
from .errors import PacktoolError  # noqa: E402
from .pipeline import pack_dataset, tokenize_dataset  # noqa: E402
from .stats import compute_stats  # noqa: E402

__all__ = ["__version__", "TokenizeConfig", "PackConfig", "PacktoolError", "tokenize_dataset", "pack_dataset", "compute_stats"]
