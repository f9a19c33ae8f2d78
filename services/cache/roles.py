"""Two guards the words' set alone cannot give: who is where around a direction marker, and when.

"from savings to checking" and "from checking to savings" hold the same words; what differs is the
word each marker governs. ``arguments`` maps each marker (from, to, into, than, 从, 到, 成, 给 ...)
to the first content word after it; two questions swap roles when, for a marker both use, each
names as its argument a word the other question also holds, in another role. A paraphrase that
reorders the sentence keeps each marker's argument, and one that swaps a word for a synonym does
not hold the other's word, so neither is refused.

``times`` reads the time a question is about (yesterday/tomorrow, last/next month, weekdays,
months, seasons, 昨天/明天, 去年/明年, 上午/下午 ...) as a set of classes, compared like the
numbers are: equal or refused."""

from __future__ import annotations

import re
from collections.abc import Callable

# English markers whose object names a role: source, target, the compared side, the unit asked in
_EN_MARKERS = frozenset("from to into onto towards toward than in for per versus vs via".split())
_ARROWS = re.compile(r"->|=>|→|⇒")
# Chinese markers (one character): from, to, toward, into/as, convert, exchange, fly, give, compare, take, mail
_ZH_MARKERS = frozenset("从到至往向成转兑飞给比把寄迁化译替")
_ZH_SKIP = frozenset("的了吗呢吧啊呀么是在我你他她它们这那有个和与及或请问一下能可以会要想应该该如何怎样什为谁哪些里"
                     "中上下来去对被让用就都也还又很太更最多少几点时候怎办换")
_WORD = re.compile(r"[a-z][a-z0-9+#]*|->|=>|→|⇒|\d+")
# the sentence that asks: context and pleasantries around it name times and sides that are not asked about
_SENTENCE_END = re.compile(r"(?<=[!?。！？])\s*|(?<=[.;；])\s+|\n+")
_GREETING = re.compile(r"\bgood (?:morning|afternoon|evening|night|day)\b|早上好|早安|上午好|中午好|下午好|晚上好|晚安")

_ASK_LEAD = re.compile(r"请问|想问一下|想问|问一下|请教一下|请教|：|:\s")


def ask(text: str) -> str:
    """The last sentence that asks (ends in ? or ？), else the last sentence, from its last lead-in
    (请问, 想问, a colon) on; greetings left out."""
    sentences = [s for s in _SENTENCE_END.split(_GREETING.sub(" ", text)) if s.strip(" ,，.。!！")]
    if not sentences:
        return text
    asking = [s for s in sentences if s.rstrip().endswith(("?", "？"))]
    sentence = (asking or sentences)[-1]
    lead = list(_ASK_LEAD.finditer(sentence))  # "..., 请问 X？", "here goes: X?": the ask is X
    rest = sentence[lead[-1].end():] if lead else ""
    return rest if rest.strip(" ?？") else sentence


def _en_arguments(lowered: str, function: frozenset[str], stem: Callable[[str], str]) -> frozenset[tuple[str, str]]:
    tokens = [_ARROWS.sub("to", t) if _ARROWS.fullmatch(t) else t for t in _WORD.findall(lowered)]
    found = set()
    for i, t in enumerate(tokens):
        if t not in _EN_MARKERS:
            continue
        for nxt in tokens[i + 1:i + 5]:
            word = stem(nxt)
            if word in _EN_MARKERS:
                break
            if word not in function:
                found.add((t, word))
                break
    return frozenset(found)


def _zh_arguments(text: str) -> frozenset[tuple[str, str]]:
    found, lower = set(), text.lower()
    for i, ch in enumerate(text):
        if ch not in _ZH_MARKERS:
            continue
        for j in range(i + 1, min(i + 4, len(text))):
            nxt = text[j]
            if nxt in _ZH_MARKERS or not ("\u4e00" <= nxt <= "\u9fff" or nxt.isalnum()):
                break
            latin = _WORD.match(lower, j) if nxt.isascii() else None
            if latin:  # a Latin word (or number) after the marker is the argument, whole
                found.add((ch, latin.group()))
                break
            if nxt not in _ZH_SKIP:
                found.add((ch, nxt))
                break
    return frozenset(found)


def arguments(text: str, lowered: str, function: frozenset[str],
              stem: Callable[[str], str]) -> frozenset[tuple[str, str]]:
    """(marker, argument) pairs: the first content word (Chinese: character) after each marker."""
    return _en_arguments(lowered, function, stem) | _zh_arguments(text)


def swapped_roles(a_args: frozenset[tuple[str, str]], a_words: frozenset[str],
                  b_args: frozenset[tuple[str, str]], b_words: frozenset[str]) -> bool:
    """True when, for a marker both questions use, each gives it an argument the other holds
    elsewhere: the same things in exchanged roles."""
    for marker in {m for m, _ in a_args} & {m for m, _ in b_args}:
        a_only = {w for m, w in a_args - b_args if m == marker}
        b_only = {w for m, w in b_args - a_args if m == marker}
        if a_only & b_words and b_only & a_words:
            return True
    return False


# --- time --------------------------------------------------------------------------------------
def _classes(table: dict[str, str]) -> dict[str, str]:
    return {word: cls for cls, words in table.items() for word in words.split()}


_EN_TIMES = _classes({
    "d-1": "yesterday", "d0": "today", "tonight": "tonight", "d+1": "tomorrow",
    "morning": "morning mornings", "noon": "noon midday lunchtime", "afternoon": "afternoon afternoons",
    "evening": "evening evenings", "night": "night nights overnight midnight",
    "mon": "monday mondays", "tue": "tuesday tuesdays", "wed": "wednesday wednesdays",
    "thu": "thursday thursdays", "fri": "friday fridays", "sat": "saturday saturdays",
    "sun": "sunday sundays", "weekend": "weekend weekends", "weekday": "weekday weekdays",
    "jan": "january", "feb": "february", "mar": "march", "apr": "april", "jun": "june", "jul": "july",
    "aug": "august", "sep": "september sept", "oct": "october", "nov": "november", "dec": "december",
    "spring": "spring", "summer": "summer", "autumn": "fall autumn", "winter": "winter",
})
_EN_RELATIVE = re.compile(r"\b(last|past|previous|this|current|next|coming|upcoming|following)\s+"
                          r"(day|week|weekend|month|quarter|year|semester|term|season|time|night)\b")
_RELATIVE = {"last": "-1", "past": "-1", "previous": "-1", "this": "0", "current": "0",
             "next": "+1", "coming": "+1", "upcoming": "+1", "following": "+1"}
_ZH_TIMES = _classes({
    "d-2": "前天", "d-1": "昨天 昨日 昨晚", "d0": "今天 今日 今晚 现在 当天", "d+1": "明天 明日 明早 明晚",
    "d+2": "后天", "y-1": "去年", "y0": "今年 本年", "y+1": "明年 来年", "y-2": "前年", "y+2": "后年",
    "w-1": "上周 上星期 上个星期 上礼拜", "w0": "本周 这周 这个星期 这星期", "w+1": "下周 下星期 下个星期 下礼拜",
    "m-1": "上个月 上月", "m0": "本月 这个月", "m+1": "下个月 下月",
    "q-1": "上季度 上个季度", "q0": "本季度 这个季度", "q+1": "下季度 下个季度",
    "morning": "早上 上午 早晨 清晨 早餐 早饭", "noon": "中午 午餐 午饭", "afternoon": "下午",
    "evening": "晚上 傍晚 晚餐 晚饭 夜里 夜间", "night": "深夜 凌晨 半夜",
    "weekend": "周末", "spring": "春天 春季", "summer": "夏天 夏季", "autumn": "秋天 秋季",
    "winter": "冬天 冬季",
})
_ZH_WEEKDAY = re.compile(r"(?:周|星期|礼拜)([一二三四五六日天])")


def times(text: str, lowered: str) -> frozenset[str]:
    """The time classes a question names (relative days, parts of day, weekdays, months, seasons)."""
    words = set(re.findall(r"[a-z]+", lowered))
    found = {_EN_TIMES[w] for w in words if w in _EN_TIMES}
    found |= {f"{unit}{_RELATIVE[rel]}" for rel, unit in _EN_RELATIVE.findall(lowered)}
    found |= {cls for w, cls in _ZH_TIMES.items() if w in text}
    found |= {"wd" + d.replace("天", "日") for d in _ZH_WEEKDAY.findall(text)}
    return frozenset(found)
