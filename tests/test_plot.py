"""`stats --plot`: a real PNG from the demo packs; a clear message without matplotlib."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from clirun import packtool
from PIL import Image


def test_plot_png_from_demo(demo_dirs, tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "fig" / "stats.png"
    r = packtool("stats", demo_dirs["packed"], "--plot", out)
    assert r.returncode == 0, r.stderr
    assert "token fill" in r.stdout  # the table is still printed
    with Image.open(out) as im:
        assert im.format == "PNG" and im.size == (720, 480)
        px = np.asarray(im.convert("RGB"))
    assert out.stat().st_size < 150_000
    # sorted fill lines: blue (tokens), orange (vision); green bars (samples per pack); purple (packed padding)
    for colour in ((0x4C, 0x72, 0xB0), (0xDD, 0x84, 0x52), (0x55, 0xA8, 0x68), (0x81, 0x72, 0xB3)):
        assert (np.abs(px.astype(int) - colour).sum(axis=2) < 6).sum() > 100, colour


def _demo_pair(demo_dirs):
    from packtool.stats import load_stats_data, summarize

    data = load_stats_data(demo_dirs["tokenized"], demo_dirs["packed"])
    return data, summarize(data)


def test_figure_bytes_depend_only_on_the_data(demo_dirs, tmp_path):
    pytest.importorskip("matplotlib")
    from packtool.plotting import figure_digest, plot_stats

    data, stats = _demo_pair(demo_dirs)
    a = plot_stats(data, stats, tmp_path / "a.png")
    b = plot_stats(data, stats, tmp_path / "b.png")
    assert a.read_bytes() == b.read_bytes()
    with Image.open(a) as im:
        assert im.info["Description"] == f"packtool stats figure, data sha256 {figure_digest(data, stats)}"
        assert "Software" not in im.info


def test_panels_show_sorted_fill_fitted_axes_and_drops_by_reason(demo_dirs, tmp_path):
    plt = pytest.importorskip("matplotlib.pyplot")
    from packtool.plotting import _drops, _fill_sorted, _samples_per_pack

    data, stats = _demo_pair(demo_dirs)
    fig, (a, b, c) = plt.subplots(1, 3)
    _fill_sorted(a, data, stats)
    tokens = a.lines[0].get_ydata()
    assert list(tokens) == sorted(tokens, reverse=True) and len(tokens) == stats["packs"]
    assert a.get_xlim() == (0.5, stats["packs"] + 0.5)
    _samples_per_pack(b, data)
    lo, hi = int(data.pack_samples.min()), int(data.pack_samples.max())
    assert b.get_xlim() == pytest.approx((lo - 0.6, hi + 0.6))  # not 0 .. far past the data
    messy = {**stats, "rejected": {"total": 3, "tokenize": {"bad_json": 2}, "pack": {"oversize": 1}}, "alone": 0}
    _drops(c, messy)
    assert [t.get_text() for t in c.get_yticklabels()] == ["tokenize: bad_json", "pack: oversize"]
    assert [p.get_width() for p in c.patches] == [2, 1]
    plt.close(fig)


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
