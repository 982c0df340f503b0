"""Figure 10 names what it cannot draw: constructions alike on every item are drawn once and named, and a
precision with no split says so instead of drawing flat lines at 0."""

from __future__ import annotations

import pandas as pd
import pytest

from report_data import synthetic_fidelity
from stagereplay.analysis import fidelity_figures
from stagereplay.analysis.fidelity import item_summary


@pytest.fixture
def drawn(monkeypatch):
    """The figure plot_split_predictors would save, kept open for the test."""
    kept = []
    monkeypatch.setattr(fidelity_figures, "save_figure", lambda fig, paths: kept.append(fig))
    return kept


def _items(twin: bool) -> pd.DataFrame:
    steps = synthetic_fidelity(n_items=8)
    if twin:
        copy = steps[steps["construction"] == "prefill"].assign(construction="prefix_cached")
        steps = pd.concat([steps, copy], ignore_index=True)
    items = item_summary(steps)
    items["positions"] = 8
    return items


def _texts(fig) -> list[str]:
    return [t.get_text() for ax in fig.axes for t in ax.texts]


def test_alike_constructions_are_drawn_once_and_named(drawn):
    fidelity_figures.plot_split_predictors(_items(twin=True), {})
    fig = drawn[0]
    bf16_curves = fig.axes[1]
    assert any("prefill = prefix_cached" in t and "alike on all 8 items" in t for t in _texts(fig))
    # bf16: chunked, prefill and prefix_cached split on the same items at the same steps: one step line
    assert len(bf16_curves.lines) == 1


def test_a_precision_without_a_split_says_so(drawn):
    fidelity_figures.plot_split_predictors(_items(twin=False), {})
    fig = drawn[0]
    fp32_curves = fig.axes[3]
    assert not fp32_curves.lines and any(t.startswith("no splits at fp32") for t in _texts(fig))
    assert not any(t.startswith("no splits") for t in (x.get_text() for x in fig.axes[1].texts))
