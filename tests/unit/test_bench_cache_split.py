"""bench.cache_split: the threshold is chosen on the development pairs only, and the figures are
given on the held-out pairs at it (overall, per language, per kind) with the issue's goal."""

from pathlib import Path

import pytest

from bench.cache_split import at_threshold, calibrate, load_split, split_report

HEADER = "# label\tkind\ta\tb\n"


def write(path: Path, rows: list[tuple[str, str, str, str]]) -> None:
    path.write_text(HEADER + "".join("\t".join(r) + "\n" for r in rows), encoding="utf-8")


@pytest.fixture
def data(tmp_path):
    write(tmp_path / "cache_pairs_en.tsv", [("hit", "paraphrase", "a1", "b1"), ("miss", "number", "a2", "b2")])
    write(tmp_path / "cache_dev2_zh.tsv", [("hit", "typo", "问1", "问2"), ("miss", "entity", "问3", "问4")])
    write(tmp_path / "cache_heldout_en.tsv", [("hit", "synonym", "h1", "h2"), ("miss", "negation", "h3", "h4"),
                                              ("hit", "filler", "h5", "h6")])
    (tmp_path / "unrelated.tsv").write_text("hit\tx\ty\tz\n")
    return tmp_path


SIMS = {"a1": 0.80, "a2": 0.70, "问1": 0.90, "问3": 0.75,   # dev: misses under 0.76, hits over it
        "h1": 0.85, "h3": 0.95, "h5": 0.60}                 # held out: a miss at 0.95 would push t up


def scored(rows):
    for r in rows:
        r["sim"], r["guard"] = SIMS[r["a"]], None
    return rows


def test_files_are_split_by_name_and_rows_say_their_split(data):
    files, rows = load_split(data)
    assert files == {"dev": ["cache_dev2_zh.tsv", "cache_pairs_en.tsv"], "heldout": ["cache_heldout_en.tsv"]}
    assert {(r["file"], r["split"], r["lang"]) for r in rows} == {
        ("cache_pairs_en.tsv", "dev", "en"), ("cache_dev2_zh.tsv", "dev", "zh"),
        ("cache_heldout_en.tsv", "heldout", "en")}
    assert sum(r["split"] == "heldout" for r in rows) == 3


def test_calibration_refuses_held_out_rows(data):
    _, rows = load_split(data)
    with pytest.raises(ValueError):
        calibrate(scored(rows), at_threshold)


def test_threshold_chosen_on_dev_and_held_out_rows_change_nothing(data):
    files, rows = load_split(data)
    report = split_report(files, scored(rows), at_threshold, default=0.85)
    assert report["calibration"]["threshold"] == 0.76  # lowest grid step over dev's highest miss (0.75)
    assert report["calibration"]["dev"]["false_hit_rate"] == 0.0 and report["calibration"]["dev"]["recall"] == 1.0
    held = report["heldout_at_calibrated"]
    assert held["all"] == {"pairs": 3, "should_hit": 2, "must_not_hit": 1, "hits": 1, "false_hits": 1,
                           "recall": 0.5, "false_hit_rate": 1.0, "precision": 0.5}
    assert held["by_lang"].keys() == {"en"} and set(held["by_kind"]) == {"synonym", "negation", "filler"}
    assert held["by_kind"]["filler"]["recall"] == 0.0
    assert report["heldout_at_default"]["threshold"] == 0.85
    assert report["heldout_at_default"]["all"]["hits"] == 1
    assert report["goals"] == {"recall_min": 0.6, "false_hit_rate_max": 0.01, "recall": 0.5,
                               "false_hit_rate": 1.0, "met": False}

    held_sims = {"h1": 0.99, "h3": 0.99, "h5": 0.99}       # held-out rows changed: the choice is not
    for r in rows:
        if r["split"] == "heldout":
            r["sim"] = held_sims[r["a"]]
    again = split_report(files, rows, at_threshold, default=0.85)
    assert again["calibration"] == report["calibration"]


def test_goal_met_and_guards_veto(data):
    files, rows = load_split(data)
    scored(rows)
    for r in rows:
        if r["a"] == "h3":
            r["guard"] = "negation"   # the guard vetoes the held-out miss
        if r["a"] == "h5":
            r["sim"] = 0.9
    report = split_report(files, rows, at_threshold, default=0.85)
    assert report["goals"]["met"] is True and report["goals"]["recall"] == 1.0
    assert report["heldout_at_calibrated"]["all"]["false_hits"] == 0


def test_no_threshold_meets_the_bound(data):
    files, rows = load_split(data)
    for r in scored(rows):
        r["sim"] = 0.999  # every dev miss is over the grid
    report = split_report(files, rows, at_threshold, default=0.85)
    assert report["calibration"]["threshold"] is None and report["heldout_at_calibrated"] is None
    assert report["goals"]["met"] is False


def test_verifier_threshold_is_chosen_on_dev_judgements_only(data):
    from bench.cache import judged_at

    files, rows = load_split(data)
    scored(rows)
    verdicts = {"a1": "yes", "a2": "yes", "问1": "yes", "问3": "no",   # dev: the 0.70 miss judged yes
                "h1": "yes", "h3": "yes", "h5": "yes"}
    for r in rows:
        r["judge"] = verdicts[r["a"]]
    report = split_report(files, rows, judged_at, 0.6, [0.6, 0.65, 0.7, 0.75, 0.8])
    assert report["calibration"]["threshold"] == 0.75  # over dev's judged-yes miss (0.70)
    assert report["heldout_at_calibrated"]["all"]["hits"] == 1  # h1 (0.85); h5 under 0.75
    assert report["heldout_at_calibrated"]["all"]["false_hits"] == 1  # h3: the judge said yes
    for r in rows:
        if r["split"] == "heldout":
            r["judge"] = "no"
    assert split_report(files, rows, judged_at, 0.6, [0.6, 0.65, 0.7, 0.75, 0.8])["calibration"] == \
        report["calibration"]
