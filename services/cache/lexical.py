"""When two questions' content words differ, whether they differ as a typo or inflection does
(conect/connect, boil/boiled) or as a swapped word does (cats/dogs).

A paraphrase adds, drops or reorders words; one that holds a word the other lacks on BOTH sides
asks something else, unless each such word has a near twin on the other side: one edit apart
(insertion, deletion, substitution or adjacent transposition: the common typos) for words of 5
letters or more, two for 10 or more, or one word the other's prefix with at most 3 letters more
(an inflection: charge/charged). Few words differ between paraphrases: past ``MAX_PAIRING``
differing words on a side, no pairing is tried (and the texts are taken to differ)."""

from __future__ import annotations

MAX_PAIRING = 8
MAX_WORD = 32  # longer "words" (hashes, pasted blobs) are matched only exactly: edits is quadratic in length


def edits(a: str, b: str, cap: int) -> int:
    """Optimal-string-alignment distance between a and b, or cap + 1 once it is over cap."""
    if abs(len(a) - len(b)) > cap:
        return cap + 1
    prev2: list[int] = []
    prev = list(range(len(b) + 1))
    for i in range(1, len(a) + 1):
        cur = [i] + [0] * len(b)
        for j in range(1, len(b) + 1):
            cost = a[i - 1] != b[j - 1]
            cur[j] = min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + cost)
            if i > 1 and j > 1 and a[i - 1] == b[j - 2] and a[i - 2] == b[j - 1]:
                cur[j] = min(cur[j], prev2[j - 2] + 1)
        if min(cur) > cap:
            return cap + 1
        prev2, prev = prev, cur
    return prev[-1]


def near(a: str, b: str) -> bool:
    """a and b are one word misspelt or inflected (see the module's doc)."""
    short, long_ = sorted((a, b), key=len)
    if len(short) >= 4 and long_.startswith(short) and len(long_) - len(short) <= 3:
        return True
    if not (a.isalpha() and b.isalpha()) or a[0] != b[0] or len(short) < 5 or len(long_) > MAX_WORD:
        return False
    cap = 2 if len(short) >= 10 else 1
    return edits(a, b, cap) <= cap


def extra(a: frozenset[str], b: frozenset[str]) -> frozenset[str]:
    """a's words b lacks and has no near twin of (all of them past ``MAX_PAIRING``)."""
    only_a, only_b = a - b, b - a
    if len(only_a) > MAX_PAIRING or len(only_b) > MAX_PAIRING:
        return only_a
    return frozenset(w for w in only_a if not any(near(w, v) for v in only_b))


def swapped(a: frozenset[str], b: frozenset[str]) -> bool:
    """Each side holds a content word the other lacks, with no near twin there."""
    return bool(a - b) and bool(b - a) and bool(extra(a, b)) and bool(extra(b, a))


def covered(names: frozenset[str], words: frozenset[str]) -> bool:
    """Every name is among words, or has a near twin there (a misspelt or inflected name)."""
    missing = names - words
    if len(missing) > MAX_PAIRING:
        return False
    return all(any(near(n, w) for w in words) for n in missing)


def poles_conflict(a: frozenset[str], b: frozenset[str]) -> bool:
    """Direction classes (``amount+``, ``amount-``, ``compass_n`` ...) pointing opposite ways: a
    scale both name, at different poles."""
    def scales(classes: frozenset[str]) -> dict[str, set[str]]:
        out: dict[str, set[str]] = {}
        for c in classes:
            base = c.split("_")[0] if "_" in c else c.rstrip("+-")
            out.setdefault(base, set()).add(c)
        return out
    sa, sb = scales(a), scales(b)
    return any(sa[s] != sb[s] for s in sa.keys() & sb.keys())
