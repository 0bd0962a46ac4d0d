"""The parity harness itself: a scenario that raises on one rank, kills a
rank or hangs fails alone, and the scenarios after it still run."""
from dist_harness import run_items_on_ranks


def test_one_failing_item_fails_alone_and_the_rest_still_run():
    items = ["ok-a", "raise-on-rank-1", "ok-b", "large-result", "kill-rank-0", "ok-c", "hang", "ok-d"]
    outcome = run_items_on_ranks(2, "harness_scenarios:run_item", items, item_deadline_s=12)
    assert set(outcome) == set(items)
    for item in ("ok-a", "ok-b", "ok-c", "ok-d"):
        assert outcome[item] == [f"{item} on 0", f"{item} on 1"], outcome[item]
    assert outcome["large-result"] == ["x" * (8 << 20)] * 2, str(outcome["large-result"])[:200]
    assert "rank 1 raised" in outcome["raise-on-rank-1"] and "ValueError: planted" in outcome["raise-on-rank-1"]
    assert "rank(s) [0] died" in outcome["kill-rank-0"] and "7" in outcome["kill-rank-0"]
    assert "no progress" in outcome["hang"]
