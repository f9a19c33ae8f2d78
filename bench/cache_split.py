"""The labelled pairs split into a development part (thresholds are chosen on it) and a held-out
part (figures are reported on it), and the scoring of a threshold on either.

Files in the data directory, each ``label kind a b`` tab-separated (``#`` starts a comment):
development ``cache_pairs_{lang}.tsv`` (the guards were written against these) and
``cache_dev2_{lang}.tsv``; held out ``cache_heldout_{lang}.tsv``. ``calibrate`` takes only
development rows and refuses any other, so nothing is ever chosen on the held-out part.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path

DEV_GLOBS = ("cache_pairs_*.tsv", "cache_dev2_*.tsv")
HELDOUT_GLOBS = ("cache_heldout_*.tsv",)
MAX_FALSE_HITS = 0.01    # the goal: false hits on held-out pairs at most 1 %
MIN_RECALL = 0.60        # ... with recall at least 60 %
GRID = tuple(round(0.30 + 0.01 * i, 2) for i in range(70))  # 0.30 .. 0.99


def _files(data: Path, globs: Iterable[str]) -> list[Path]:
    return sorted({p for g in globs for p in data.glob(g)})


def read_pairs(path: Path, split: str) -> list[dict]:
    lang = path.stem.rsplit("_", 1)[1]
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.startswith("#") or not line.strip():
            continue
        label, kind, a, b = line.split("\t")
        rows.append({"hit": label == "hit", "kind": kind, "lang": lang, "a": a, "b": b,
                     "split": split, "file": path.name})
    return rows


def load_split(data: Path) -> tuple[dict, list[dict]]:
    """Which files are development and which held out, and all their rows (each row says its split)."""
    dev, held = _files(data, DEV_GLOBS), _files(data, HELDOUT_GLOBS)
    rows = [r for p in dev for r in read_pairs(p, "dev")] + [r for p in held for r in read_pairs(p, "heldout")]
    return {"dev": [p.name for p in dev], "heldout": [p.name for p in held]}, rows


def score(rows: list[dict], says_hit: Callable[[dict], bool]) -> dict:
    pos = [r for r in rows if r["hit"]]
    neg = [r for r in rows if not r["hit"]]
    tp = sum(map(says_hit, pos))
    fp = sum(map(says_hit, neg))
    return {"pairs": len(rows), "should_hit": len(pos), "must_not_hit": len(neg), "hits": tp, "false_hits": fp,
            "recall": round(tp / len(pos), 3) if pos else None,
            "false_hit_rate": round(fp / len(neg), 3) if neg else None,
            "precision": round(tp / (tp + fp), 3) if tp + fp else None}


def at_threshold(threshold: float, guards: bool = True) -> Callable[[dict], bool]:
    """The cosine stage (and the guards' veto): a row needs ``sim`` and ``guard``."""
    return lambda r: r["sim"] >= threshold and (not guards or r["guard"] is None)


def calibrate(dev: list[dict], says_hit_at: Callable[[float], Callable[[dict], bool]],
              grid: Iterable[float] = GRID, max_false_hits: float = MAX_FALSE_HITS) -> dict:
    """The lowest threshold on ``grid`` whose false-hit rate on the development rows is within
    ``max_false_hits`` (None when none is); its development figures."""
    if any(r["split"] != "dev" for r in dev):
        raise ValueError("calibration reads development pairs only")
    grid = sorted(grid)
    span = [grid[0], grid[-1]] if grid else None
    for t in grid:
        s = score(dev, says_hit_at(t))
        if (s["false_hit_rate"] or 0.0) <= max_false_hits:
            return {"threshold": t, "grid": span, "max_false_hit_rate": max_false_hits, "dev": s}
    return {"threshold": None, "grid": span, "max_false_hit_rate": max_false_hits, "dev": None}


def breakdown(rows: list[dict], says_hit: Callable[[dict], bool]) -> dict:
    """Overall, per language and per kind."""
    return {"all": score(rows, says_hit),
            "by_lang": {lang: score([r for r in rows if r["lang"] == lang], says_hit)
                        for lang in sorted({r["lang"] for r in rows})},
            "by_kind": {kind: score([r for r in rows if r["kind"] == kind], says_hit)
                        for kind in sorted({r["kind"] for r in rows})}}


def goals(heldout: dict | None) -> dict:
    """The issue's goal on the held-out figures at the calibrated threshold."""
    recall = heldout["recall"] if heldout else None
    fhr = heldout["false_hit_rate"] if heldout else None
    met = recall is not None and fhr is not None and recall >= MIN_RECALL and fhr <= MAX_FALSE_HITS
    return {"recall_min": MIN_RECALL, "false_hit_rate_max": MAX_FALSE_HITS, "recall": recall,
            "false_hit_rate": fhr, "met": met}


def split_report(files: dict, rows: list[dict], says_hit_at: Callable[[float], Callable[[dict], bool]],
                 default: float, grid: Iterable[float] = GRID) -> dict:
    """Choose on dev, report on held-out (and at the shipped default, for comparison)."""
    dev = [r for r in rows if r["split"] == "dev"]
    held = [r for r in rows if r["split"] == "heldout"]
    chosen = calibrate(dev, says_hit_at, grid)
    out: dict = {"files": files, "calibration": chosen}
    t = chosen["threshold"]
    out["heldout_at_calibrated"] = breakdown(held, says_hit_at(t)) if held and t is not None else None
    out["heldout_at_default"] = {"threshold": default, **breakdown(held, says_hit_at(default))} if held else None
    out["dev_at_default"] = {"threshold": default, **breakdown(dev, says_hit_at(default))} if dev else None
    out["goals"] = goals(out["heldout_at_calibrated"]["all"] if out["heldout_at_calibrated"] else None)
    return out
