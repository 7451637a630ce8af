"""`stats --plot`: a real PNG from the demo packs; a clear message without matplotlib, for a name that is
no figure format, and for a path that cannot be written."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

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


@pytest.mark.parametrize("suffix", [".svg", ".pdf"])
def test_svg_and_pdf_bytes_depend_only_on_the_data(demo_dirs, tmp_path, suffix):
    pytest.importorskip("matplotlib")
    from packtool.plotting import plot_stats

    data, stats = _demo_pair(demo_dirs)
    a = plot_stats(data, stats, tmp_path / f"a{suffix}").read_bytes()
    time.sleep(1.1)  # a timestamp written to the second would differ
    b = plot_stats(data, stats, tmp_path / f"b{suffix}").read_bytes()
    assert a == b
    for stamp in (b"CreationDate", b"Producer", b"<dc:date>", b"Matplotlib v"):  # a date or a version
        assert stamp not in a, stamp


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


@pytest.mark.parametrize("name, what", [
    ("stats.txt", "ends in .txt, which is not a figure format packtool writes"),
    ("stats.jpg", "ends in .jpg, which is not a figure format packtool writes"),
    ("stats", "has no suffix to say the figure format"),  # was written as stats.png without a word
])
def test_plot_name_without_a_figure_suffix_is_a_usage_error(tmp_path, name, what):
    out = tmp_path / name
    # the directory does not exist: the name is refused before any statistics are read
    r = packtool("stats", tmp_path / "nope", "--plot", out)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.splitlines()[-1] == (f"Error: Invalid value for '--plot': {str(out)!r} {what}; "
                                         "end the name in .png, .svg or .pdf")
    assert list(tmp_path.iterdir()) == []


def test_plot_library_call_refuses_a_name_without_a_figure_suffix(demo_dirs, tmp_path):
    from packtool.errors import ConfigError
    from packtool.plotting import plot_stats

    data, stats = _demo_pair(demo_dirs)
    with pytest.raises(ConfigError) as exc:
        plot_stats(data, stats, tmp_path / "stats.txt")
    assert str(exc.value) == (f"--plot {str(tmp_path / 'stats.txt')!r} ends in .txt, which is not a figure format "
                              "packtool writes; end the name in .png, .svg or .pdf")


def test_plot_suffix_picks_the_format_in_any_case_and_missing_folders_are_made(demo_dirs, tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "a" / "b" / "stats.SVG"
    r = packtool("stats", demo_dirs["packed"], "--plot", out)
    assert r.returncode == 0, r.stderr
    assert out.read_bytes().startswith(b"<?xml") and b"<svg" in out.read_bytes()
    assert sorted(p.name for p in out.parent.iterdir()) == ["stats.SVG"]


def test_plot_to_a_directory_is_one_error_line(demo_dirs, tmp_path):
    pytest.importorskip("matplotlib")
    d = tmp_path / "d.png"
    d.mkdir()
    r = packtool("stats", demo_dirs["packed"], "--plot", d)
    assert r.returncode == 1 and r.stdout == ""
    assert r.stderr == (f"Error: cannot write the plot to {str(d)!r}: it is a directory; name a file in it, "
                        f"e.g. {str(d / 'stats.png')!r}\n")
    assert list(d.iterdir()) == []


def test_plot_under_a_file_is_one_error_line(demo_dirs, tmp_path):
    pytest.importorskip("matplotlib")
    (tmp_path / "notes").write_text("x")
    out = tmp_path / "notes" / "figs" / "stats.png"
    r = packtool("stats", demo_dirs["packed"], "--plot", out)
    assert r.returncode == 1 and r.stdout == ""
    assert r.stderr == (f"Error: cannot write the plot to {str(out)!r}: {str(tmp_path / 'notes')!r} is a file, "
                        "not a folder; pass --plot a path you can write to\n")


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full, where every write fails: disk full")
@pytest.mark.parametrize("suffix", [".png", ".pdf"])  # matplotlib's PDF writer fails on a full disk with its own AttributeError
def test_plot_to_a_full_disk_is_one_error_line(demo_dirs, tmp_path, suffix):
    pytest.importorskip("matplotlib")
    out = tmp_path / f"stats{suffix}"
    out.symlink_to("/dev/full")
    r = packtool("stats", demo_dirs["packed"], "--plot", out)
    assert r.returncode == 1 and r.stdout == ""
    assert r.stderr == (f"Error: cannot write the plot to {str(out)!r}: no space left on device; "
                        "free some space or pass --plot another path\n")


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="root writes through permission bits")
def test_plot_into_a_folder_without_write_permission_is_one_error_line(demo_dirs, tmp_path):
    pytest.importorskip("matplotlib")
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    try:
        r = packtool("stats", demo_dirs["packed"], "--plot", locked / "stats.png")
    finally:
        locked.chmod(0o755)
    assert r.returncode == 1 and r.stdout == ""
    assert r.stderr == (f"Error: cannot write the plot to {str(locked / 'stats.png')!r}: permission denied; "
                        "pass --plot a path you can write to\n")
    assert list(locked.iterdir()) == []


def _drawn(data, stats):
    """The figure as plot_stats lays it out, drawn, with its four panels."""
    plt = pytest.importorskip("matplotlib.pyplot")
    import matplotlib

    from packtool.plotting import FIGURE_RC, _figure

    with matplotlib.rc_context(FIGURE_RC):
        fig = _figure(plt, data, stats, 80)
        fig.canvas.draw()
    return fig, fig.axes


def test_panels_of_a_tokenized_dir_have_no_stray_ticks_and_say_what_it_holds(demo_dirs):
    # the empty fill and samples-per-pack panels showed ticks 0 and 1 (the whole-number locators were
    # set after the panels were emptied), and the drops panel said "none: every row was packed" of a
    # directory that holds no packs
    from packtool.stats import load_stats_data, summarize

    data = load_stats_data(demo_dirs["tokenized"])
    fig, (a_fill, a_spp, _, a_drop) = _drawn(data, summarize(data))
    for ax in (a_fill, a_spp, a_drop):
        assert (list(ax.get_xticks()), list(ax.get_yticks())) == ([], [])
    assert [t.get_text() for t in a_drop.texts] == ["none: all 30 rows were tokenized"]
    _, (_, _, _, a_drop) = _drawn(*_demo_pair(demo_dirs))
    assert [t.get_text() for t in a_drop.texts] == ["none: all 30 rows were packed"]
    import matplotlib.pyplot as plt

    plt.close("all")


def test_every_title_and_label_of_a_run_with_rejections_lies_inside_the_figure(demo_dirs):
    # with rejections by reason, "rejected and dropped rows (of 65 rows in)" was wider than its
    # panel and ran off the right edge of the figure
    data, stats = _demo_pair(demo_dirs)
    messy = {**stats, "rows_in": 65, "alone": 2, "truncated": 1,
             "rejected": {"total": 5, "tokenize": {"bad_json": 1, "missing_media": 1}, "pack": {"oversize": 3}}}
    fig, axes = _drawn(data, messy)
    renderer = fig.canvas.get_renderer()
    width, height = fig.bbox.width, fig.bbox.height
    texts = [fig._suptitle] + [t for ax in axes for t in (ax.title, ax.xaxis.label, ax.yaxis.label,
                                                          *ax.get_yticklabels(), *ax.texts)]
    for t in texts:
        if t.get_text():
            box = t.get_window_extent(renderer)
            assert box.x0 >= 0 and box.x1 <= width and box.y0 >= 0 and box.y1 <= height, (t.get_text(), box.bounds)
    a_drop = axes[3]
    assert a_drop.get_title() == "rejected and dropped rows" and a_drop.get_xlabel() == "rows (of 65 rows in)"
    assert [t.get_text() for t in a_drop.get_yticklabels()] == [
        "tokenize: bad_json", "tokenize: missing_media", "pack: oversize", "pack: alone (over capacity)",
        "pack: truncated"]
    import matplotlib.pyplot as plt

    plt.close(fig)
