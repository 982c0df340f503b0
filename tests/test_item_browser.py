"""The item browser in a real headless browser (Playwright on Chromium): rows, the divergent filter, the marked
first divergent token and the margin plot, against counts recomputed here from the ledger by plain loops.

The browser is found or installed by :mod:`headless_chromium` (the npm registry where Playwright's CDN is out of
reach); where none can be had the browser tests skip saying what to install, except on CI, where they fail.
"""

import os
from pathlib import Path

import pandas as pd
import pytest

from report_data import synthetic_ledger, synthetic_transplant, write
from headless_chromium import INSTALL_HINT, find_chromium
from stagereplay.analysis.browser_page import write_item_browser
from stagereplay.analysis.report import build_report

REPO = Path(__file__).resolve().parents[1]
# Distinct text per token id; id 7 is markup, to show that token texts are data, never parsed as HTML.
TEXTS = {i: f"w{i}\u00b7" for i in range(64)}
TEXTS[7] = "</script><b>&amp;"


@pytest.fixture(scope="module")
def chromium():
    executable, env, how = find_chromium()
    if executable is None:
        message = f"{INSTALL_HINT} ({how})"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    sync_api = pytest.importorskip("playwright.sync_api", reason=INSTALL_HINT)
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=executable, env=env, args=["--no-sandbox"])
        yield browser
        browser.close()


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    folder = tmp_path_factory.mktemp("browser")
    ledger = synthetic_ledger("primary")
    transplant = synthetic_transplant("primary")
    page = folder / "items.html"
    write_item_browser(str(page), {"primary": ledger}, {"primary": TEXTS}, {"primary": transplant}, run="t")
    return page, ledger, transplant


@pytest.fixture
def page(chromium, built):
    path, _, _ = built
    tab = chromium.new_page()
    errors = []
    tab.on("pageerror", lambda exc: errors.append(str(exc)))
    tab.goto(path.as_uri())
    yield tab
    tab.close()
    assert not errors, errors


def expected_divergences(ledger: pd.DataFrame) -> dict[int, dict[tuple[str, str], tuple]]:
    """{item: {(experiment, precision): (a, b, position, ids_a, ids_b)}} for every compared pair whose suffixes
    differ, by plain loops over the replica-1 rows."""
    pairs = {"matched": ("live", "prefill"), "fixed_prefix": ("incremental", "prefill")}
    found: dict[int, dict] = {}
    rows = ledger[ledger["replica"] == 1]
    for (item, experiment, precision), group in rows.groupby(["item_index", "experiment", "precision"]):
        by = {r["construction"]: r for _, r in group.iterrows()}
        a, b = pairs[experiment]
        if a not in by or b not in by or by[a]["status"] != "ok" or by[b]["status"] != "ok":
            continue
        ids_a, ids_b = list(by[a]["suffix_ids"]), list(by[b]["suffix_ids"])
        if ids_a == ids_b:
            continue
        position = next((i for i, (x, y) in enumerate(zip(ids_a, ids_b)) if x != y), min(len(ids_a), len(ids_b)))
        found.setdefault(int(item), {})[(experiment, precision)] = (a, b, position, ids_a, ids_b)
    return found


def visible_items(tab) -> list[int]:
    return [int(v) for v in tab.locator("#items tbody tr:visible").evaluate_all(
        "rows => rows.map(r => r.dataset.itemIndex)")]


def test_one_row_per_item_and_the_divergent_filter(page, built):
    _, ledger, _ = built
    divergent = expected_divergences(ledger)
    assert 0 < len(divergent) < ledger["item_index"].nunique()  # the filter has something to remove
    assert page.locator("#items tbody tr").count() == ledger["item_index"].nunique()
    assert sorted(visible_items(page)) == sorted(ledger["item_index"].unique().tolist())
    page.check("#divergent-only")
    assert sorted(visible_items(page)) == sorted(divergent)
    page.select_option("#cell-filter", "primary/fixed_prefix/bf16")
    in_cell = [i for i, cells in divergent.items() if ("fixed_prefix", "bf16") in cells]
    assert sorted(visible_items(page)) == sorted(in_cell)
    page.uncheck("#divergent-only")
    assert page.locator("#items tbody tr:visible").count() == ledger["item_index"].nunique()


def test_status_labels_of_excluded_items(page):
    # synthetic_ledger: item 3 never reaches its boundary, item 5's matched prefill overflows
    assert page.locator('#items tbody tr[data-item-index="3"] td').nth(2).text_content() == "boundary_missing"
    matched = page.locator('#items tbody tr[data-item-index="5"] td[data-cell="primary/matched/bf16"]')
    assert matched.locator(".status-bad").text_content() == "!"
    assert "prefill: nonfinite" in matched.get_attribute("title")


def test_selected_item_marks_the_first_divergent_token_and_plots_every_step(page, built):
    _, ledger, transplant = built
    divergent = expected_divergences(ledger)
    checked = 0
    for item, cells in sorted(divergent.items())[:6]:
        page.click(f'#items tbody tr[data-item-index="{item}"]')
        assert page.locator("#detail").get_attribute("data-item-index") == str(item)
        for (experiment, precision), (a, b, position, ids_a, ids_b) in cells.items():
            section = page.locator(f'#detail .comparison[data-cell="primary/{experiment}/{precision}"]')
            for construction, ids in ((a, ids_a), (b, ids_b)):
                marked = section.locator(f'.suffix[data-construction="{construction}"] .tok.first-divergence')
                assert marked.count() == 1
                assert marked.get_attribute("data-step") == str(position)
                assert marked.text_content() == (TEXTS[ids[position]] if position < len(ids) else "[suffix ended]")
                points = section.locator(f'svg.margins polyline[data-construction="{construction}"]'
                                         ).get_attribute("points").split()
                assert len(points) == len(ids)
            checked += 1
        shown = page.locator("#detail table.transplants tr[data-outcome]").count()
        assert shown == int((transplant["item_index"] == item).sum())
    assert checked


def four_comparisons_page(folder: Path) -> Path:
    """A page with the default run's four comparisons (matched and fixed-prefix, bf16 and fp32) and item ids as
    long as the embedded set's."""
    ledger = synthetic_ledger("primary")
    matched_fp32 = ledger[ledger["experiment"] == "matched"].assign(precision="fp32")
    ledger = pd.concat([ledger, matched_fp32], ignore_index=True)
    ledger["item_id"] = ledger["item_index"].map(lambda i: f"synthetic-0-{i:05d}")
    page = folder / "items.html"
    write_item_browser(str(page), {"primary": ledger}, {"primary": TEXTS}, {}, run="t")
    return page


@pytest.mark.parametrize("width", [1280, 960, 820], ids=["side-by-side", "snakemake-report-iframe", "stacked"])
def test_the_list_shows_every_comparison_column_whole(chromium, tmp_path, width):
    tab = chromium.new_page(viewport={"width": width, "height": 800})
    tab.goto(four_comparisons_page(tmp_path).as_uri())
    headers = tab.locator("#items thead th[data-cell]")
    assert headers.count() == 4
    pane = tab.locator("#list").bounding_box()
    assert tab.locator("#list").evaluate("e => e.scrollWidth <= e.clientWidth")  # nothing to scroll sideways to
    for i in range(4):
        box = headers.nth(i).bounding_box()
        assert pane["x"] <= box["x"] and box["x"] + box["width"] <= pane["x"] + pane["width"], (i, box, pane)
    tab.click('#items tbody tr[data-item-index="1"]')
    detail = tab.locator("#detail").bounding_box()
    assert detail["width"] >= 380 and detail["height"] >= 300  # the detail pane keeps room for its suffixes
    cell = tab.locator('#items tbody tr[data-item-index="0"] td[data-cell="primary/matched/fp32"]')
    assert "live: " in cell.get_attribute("title") and "prefill: " in cell.get_attribute("title")
    tab.close()


def test_up_and_down_keys_move_through_the_rows_shown(page, built):
    _, ledger, _ = built
    divergent = sorted(expected_divergences(ledger))
    every = sorted(ledger["item_index"].unique().tolist())
    shown = lambda: page.locator("#detail").get_attribute("data-item-index")  # noqa: E731
    page.keyboard.press("ArrowDown")  # nothing selected yet: the first row
    assert shown() == str(every[0])
    page.keyboard.press("ArrowDown")
    page.keyboard.press("ArrowDown")
    assert shown() == str(every[2])
    page.keyboard.press("ArrowUp")
    assert shown() == str(every[1])
    page.check("#divergent-only")  # the rows the filter hides are skipped
    page.click(f'#items tbody tr[data-item-index="{divergent[0]}"]')
    page.keyboard.press("ArrowDown")
    assert shown() == str(divergent[1])
    page.keyboard.press("ArrowUp")
    page.keyboard.press("ArrowUp")  # at the first row shown: stays
    assert shown() == str(divergent[0])
    for _ in divergent:
        page.keyboard.press("ArrowDown")
    assert shown() == str(divergent[-1])
    selected = page.locator("#items tbody tr.selected")
    assert selected.count() == 1 and selected.get_attribute("data-item-index") == str(divergent[-1])


def test_token_texts_are_shown_as_text(page, built):
    _, ledger, _ = built
    with_markup = ledger[ledger["suffix_ids"].map(lambda ids: 7 in list(ids)) & (ledger["replica"] == 1)]
    item = int(with_markup["item_index"].iloc[0])
    page.click(f'#items tbody tr[data-item-index="{item}"]')
    assert page.locator('#detail .tok[data-id="7"]').first.text_content() == TEXTS[7]
    assert page.locator("#detail b").count() == 0


def test_report_links_the_item_browser(tmp_path):
    ledger = write(synthetic_ledger("primary"), tmp_path / "primary" / "ledger.parquet")
    report = tmp_path / "report" / "report.md"
    build_report({"primary": ledger}, str(report), str(tmp_path / "report" / "stats.json"), "t",
                 item_browser=str(tmp_path / "report" / "items.html"))
    assert "Item browser: [items.html](items.html)" in report.read_text()


def test_token_texts_with_the_toy_tokenizer():
    from stagereplay.stages.token_texts import load_tokenizer, token_texts

    _, tokenizer = load_tokenizer("data/toy", "primary", base_dir=str(REPO))
    ids = tokenizer("12+7=19;", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    texts = token_texts(tokenizer, ids)
    assert "".join(texts[i] for i in ids) == tokenizer.decode(ids, skip_special_tokens=False)
    assert len(ids) == len("12+7=19;") + 1  # one character per token: each text is one character (or <eos>)


def test_a_ledger_from_another_model_source_is_refused(tmp_path):
    from stagereplay.io.parquet import write_parquet
    from stagereplay.models.sources import ModelLoadError
    from stagereplay.stages.token_texts import build_item_browser

    ledger = tmp_path / "primary" / "ledger.parquet"
    write_parquet(synthetic_ledger("primary"), ledger, {"parts": [{"model_source": "elsewhere/other"}]})
    with pytest.raises(ModelLoadError, match="elsewhere/other"):
        build_item_browser(str(tmp_path / "items.html"), {"primary": str(ledger)},
                           {"primary": {"model": str(REPO / "data/toy"), "revision": "primary"}})
    assert not (tmp_path / "items.html").exists()
