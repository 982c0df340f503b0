"""The end of a run and `snakemake --report`, on the shared tiny run (a copy: its readers must not change it).

The report file is opened in a headless Chromium (found or installed by :mod:`headless_chromium`; where none can be
had the browser test skips saying what to install, except on CI, where it fails) and clicked through as a reader
would: every figure must load, on its own entry and on the Report page, which Snakemake shows in a frame loaded
from a ``data:`` URL.
"""

import json
import shutil

import pytest

from headless_chromium import launched_chromium
from stagereplay.analysis import captions
from workflow_runner import snakemake

FIGURE_TITLES = [f"{number:02d}. {title}" for number, (title, _) in enumerate(captions.CAPTIONS.values(), start=1)]
IMAGES = "() => Array.from(document.images, i => [i.alt, i.complete, i.naturalWidth > 0])"


@pytest.fixture(scope="module")
def chromium():
    yield from launched_chromium()


@pytest.fixture(scope="module")
def run(shared_tiny_run, tmp_path_factory):
    return shutil.copytree(shared_tiny_run, tmp_path_factory.mktemp("report_run") / "run", symlinks=True)


@pytest.mark.slow
def test_batch_invariance_at_batch_size_1_is_not_scheduled_and_the_report_says_why(run):
    """The default config (batch_size 1) spent a job on a control with nothing to compare."""
    res = run / "results/tiny"
    assert not (res / "primary/batch_invariance.parquet").exists()
    assert not list((run / "logs/tiny/primary").glob("check_batch_invariance*"))
    report = (res / "report/report.md").read_text()
    assert ("### Batch invariance (beyond the study)\n\n_Not run: batch_size is 1, so every item was decoded alone "
            "and no batched row exists to compare") in report
    assert "_Nothing to compare" not in report
    stats = json.loads((res / "report/stats.json").read_text())["revisions"]["primary"]
    assert stats["batch_invariance"]["status"] == "not_run"
    assert "batch_invariance" not in stats.get("not_produced", [])
    planned = snakemake(run, "-n", "--forceall", "--cores", "1").stdout
    assert "check_batch_invariance" not in planned and "build_report" in planned
    batched = snakemake(run, "-n", "--forceall", "--cores", "1", "--config", "batch_size=2",
                        "decode_regime=static").stdout
    assert "check_batch_invariance" in batched  # a batched run has something to compare: the job is planned


@pytest.mark.slow
def test_the_end_of_a_run_names_its_report(run):
    proc = snakemake(run, "--cores", "1", "--forcerun", "build_report")
    path = run.resolve() / "results/tiny/report/report.md"
    assert f"Report of run tiny (written by this invocation): {path}; report.html" in proc.stdout + proc.stderr


@pytest.mark.slow
def test_snakemake_report_shows_every_figure_in_order_and_on_the_report_page(run, chromium, tmp_path):
    """The Report page's ten figures were broken images (relative paths inside a data: frame), its items.html link
    led nowhere, and the Figures list read 1, 10, 2, 3, ..."""
    snakemake(run, "--report", str(tmp_path / "report.html"))
    tab = chromium.new_page(viewport={"width": 1400, "height": 900})
    errors = []
    tab.on("pageerror", lambda exc: errors.append(str(exc)))
    tab.goto((tmp_path / "report.html").as_uri())

    tab.get_by_role("link", name="Report").click()
    tab.locator("table").first.locator("a[iconname=eye]").first.click()
    frame = tab.locator("iframe").element_handle().content_frame()
    frame.wait_for_load_state()
    assert frame.evaluate("() => location.protocol") == "data:"
    assert frame.evaluate(IMAGES) == [[name, True, True] for name in captions.CAPTIONS]
    assert frame.evaluate("() => Array.from(document.links, a => a.href)") == []  # none that resolves to nothing
    assert "items.html (a file beside report.html" in frame.evaluate("() => document.body.innerText")

    tab.get_by_role("link", name="Results").click()
    tab.get_by_role("link", name="Figures").click()
    rows = tab.locator("table").first.locator("tbody tr")
    assert [text.strip() for text in rows.all_inner_texts()] == FIGURE_TITLES  # 01, 02, ..., 10
    tab.locator("label", has_text="PNG").click()
    for i, title in enumerate(FIGURE_TITLES):
        rows.nth(i).locator("a[iconname=eye]").click()
        shown = tab.locator("img[src^='data:image/png']")
        shown.wait_for()
        assert shown.evaluate("i => i.complete && i.naturalWidth > 0"), title
    tab.close()
    assert not errors, errors
