"""dflash_common.resume_check: the one comparison of an earlier job's settings with this one's."""

from dflash_common.resume_check import first_difference, shown


def test_first_difference_names_the_first_changed_key_with_both_values():
    earlier, now = {"a": 1, "b": [1, 2], "c": "x"}, {"a": 1, "b": [1, 3], "c": "y"}
    assert first_difference(earlier, now, ["a", "b", "c"]) == "b differs (earlier run: [1, 2], this run: [1, 3])"
    assert first_difference(earlier, now, ["a"]) is None


def test_a_key_an_old_record_lacks_counts_as_its_default_and_views_pick_what_counts():
    assert first_difference({}, {"mode": "keep"}, ["mode"], defaults={"mode": "keep"}) is None
    assert first_difference({}, {"mode": "drop"}, ["mode"], defaults={"mode": "keep"}) == \
        'mode differs (earlier run: keep, this run: drop)'
    by_hash = lambda record, key: record[key]["hash"]  # noqa: E731
    assert first_difference({"t": {"hash": 1, "path": "/a"}}, {"t": {"hash": 1, "path": "/b"}}, ["t"], view=by_hash) is None
    assert first_difference({"k": 1}, {"k": 2}, ["k"], earlier_name="cache", now_name="this build") == \
        "k differs (cache: 1, this build: 2)"


def test_long_values_are_clipped():
    assert len(shown(list(range(1000)))) == 160 and shown(list(range(1000))).endswith("...")
