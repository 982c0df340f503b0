"""How an engine job's contexts share its items (stagereplay.stages.engine._rows_on_engines): each context on its
thread takes the next item not yet taken, so a context held by a long item leaves the rest to the others, and after
an error no context takes another item. No engine is loaded: the item's rows are stubbed."""

from __future__ import annotations

import threading
import time

import pytest

from stagereplay.stages import engine as stage


class Context:
    def __init__(self, name):
        self.name = name


class Settings:
    boundary, engine = None, "stub"


@pytest.fixture
def stubbed(monkeypatch):
    """_item_rows stubbed: item ``slow`` runs until every other item has run (5 s at most), ``bad`` raises, the
    others take 0.2 s; each row says which context ran it."""
    ran, lock, others_done = [], threading.Lock(), threading.Event()
    expected = {"others": 0}

    def item_rows(e, it, s, matcher, settings, replicas):
        with lock:
            ran.append((e.name, it))
        if it == "bad":
            raise RuntimeError("item bad failed")
        if it == "slow":
            others_done.wait(timeout=5)
        else:
            time.sleep(0.2)
            with lock:
                if sum(1 for _, i in ran if i != "slow") == expected["others"]:
                    others_done.set()
        return [{"item": it, "context": e.name}]

    monkeypatch.setattr(stage, "_item_rows", item_rows)
    monkeypatch.setattr(stage, "matcher_from_config", lambda boundary, e: None)
    return ran, expected


def test_a_context_held_by_a_long_item_leaves_the_rest_to_the_others(stubbed):
    ran, expected = stubbed
    items = ["slow", "a", "b", "c", "d", "e", "f"]
    expected["others"] = len(items) - 1
    rows = stage._rows_on_engines([Context(0), Context(1), Context(2)], items, Settings(), None, (1,))
    assert sorted(r["item"] for r in rows) == sorted(items)  # every item once
    by = {r["item"]: r["context"] for r in rows}
    # the context that took the slow item took nothing else; striping items[i::3] would have given it "c" and "f"
    assert [it for it, c in by.items() if c == by["slow"]] == ["slow"]
    control = {it: i % 3 for i, it in enumerate(items)}  # the striping, as the job shared items before
    assert [it for it, c in control.items() if c == control["slow"]] != ["slow"]


def test_one_context_runs_the_items_in_order(stubbed):
    rows = stage._rows_on_engines([Context(0)], ["a", "b", "c"], Settings(), None, (1,))
    assert [r["item"] for r in rows] == ["a", "b", "c"]


def test_after_an_error_no_context_takes_another_item(stubbed):
    ran, _ = stubbed
    items = ["bad", *[f"x{i}" for i in range(20)]]
    with pytest.raises(RuntimeError, match="item bad failed"):
        stage._rows_on_engines([Context(0), Context(1)], items, Settings(), None, (1,))
    # the other context finishes the item it holds and stops: far fewer than the 10 or 20 it would otherwise run
    assert len(ran) <= 3
