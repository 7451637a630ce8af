"""`stats --plot`: a real PNG from the demo packs; a clear message without matplotlib."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from PIL import Image


def test_plot_png_from_demo(demo_dirs, tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "fig" / "stats.png"
    r = subprocess.run([sys.executable, "-m", "packtool", "stats", str(demo_dirs["packed"]), "--plot", str(out)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "token fill" in r.stdout  # the table is still printed
    with Image.open(out) as im:
        assert im.format == "PNG" and im.size == (720, 480)
        px = np.asarray(im.convert("RGB"))
    assert out.stat().st_size < 150_000
    # the four panels draw coloured bars: blue (tokens), orange (vision), green (samples), purple (lengths)
    for colour in ((0x4C, 0x72, 0xB0), (0xDD, 0x84, 0x52), (0x55, 0xA8, 0x68), (0x81, 0x72, 0xB3)):
        assert (np.abs(px.astype(int) - colour).sum(axis=2) < 6).sum() > 200, colour


def test_plot_library_call_for_tokenized_dir(demo_dirs, tmp_path):
    pytest.importorskip("matplotlib")
    from packtool.plotting import plot_stats
    from packtool.stats import load_stats_data, summarize

    data = load_stats_data(demo_dirs["tokenized"])
    out = plot_stats(data, summarize(data), tmp_path / "tok.png")
    with Image.open(out) as im:
        assert im.size == (720, 480)


def test_missing_matplotlib_names_the_extra(demo_dirs, tmp_path):
    code = (
        "import sys; sys.modules['matplotlib'] = None\n"  # as if the extra were not installed
        "from packtool.cli import main\n"
        f"sys.exit(main(['stats', {str(demo_dirs['packed'])!r}, '--plot', {str(tmp_path / 'x.png')!r}]))\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 1
    assert r.stderr == "Error: --plot needs matplotlib, an optional extra: pip install packtool[plot]\n"
    assert not (tmp_path / "x.png").exists()
