"""``python -m packtool``: the command line, Ctrl-C handled from here on (:mod:`packtool.launcher`)."""

from .launcher import run

run()
