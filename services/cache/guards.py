"""Guards a semantic match must pass beyond the cosine threshold.

MiniLM scores "convert 5 miles to km" and "convert 50 miles to km", or "enable"
and "disable" questions, at 0.88-0.91: above many true paraphrases. So two
questions only share an answer when what such near-misses differ in is equal:
numbers, units, negation, direction words (enable/disable, max/min, ...), scope
words (all/only/first/...), names, code, and (Chinese) the content characters.
Each guard is a feature extracted once per text; a match needs equal features.
Also: the time named (``roles.times``), and roles exchanged around direction markers
("from A to B" / "from B to A", ``roles.swapped_roles``). The features are read from the asking
sentence (``roles.ask``); context only one question adds is left out, and content words pair
their typos and inflections (``lexical``) before two questions are said to swap one."""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from llmesh.cache.lexical import covered, extra, poles_conflict, swapped
from llmesh.cache.roles import arguments, ask, swapped_roles, times

# --- numbers ---------------------------------------------------------------------------------
_DIGITS = re.compile(r"(?<![\w.])[-+]?\d+(?:[,，]\d{3})*(?:\.\d+)?|\d+(?:\.\d+)?")
_WORD_NUMBERS = {
    "zero": 0, "one": 1, "two": 2, "three": 3, "four": 4, "five": 5, "six": 6, "seven": 7, "eight": 8,
    "nine": 9, "ten": 10, "eleven": 11, "twelve": 12, "thirteen": 13, "fourteen": 14, "fifteen": 15,
    "sixteen": 16, "seventeen": 17, "eighteen": 18, "nineteen": 19, "twenty": 20, "thirty": 30, "forty": 40,
    "fifty": 50, "sixty": 60, "seventy": 70, "eighty": 80, "ninety": 90, "hundred": 100, "thousand": 1000,
    "million": 1e6, "billion": 1e9, "dozen": 12, "half": 0.5, "twice": 2, "double": 2, "triple": 3,
}
_ZH_DIGITS = {"零": 0, "〇": 0, "一": 1, "二": 2, "两": 2, "三": 3, "四": 4, "五": 5, "六": 6, "七": 7, "八": 8,
              "九": 9}
_ZH_UNITS = {"十": 10, "百": 100, "千": 1000, "万": 10_000, "亿": 100_000_000}
# "how one applies", "should one tip": after these words "one" is the pronoun, not the figure
_ONE_AS_PRONOUN = frozenset("how can could should would may might must does do will where when why".split())
_ZH_NUMBER = re.compile(r"[零〇一二两三四五六七八九十百千万亿]+")
# "一" alone is mostly the article "a" (一个, 一下); it counts only beside another numeral.


def _zh_value(s: str) -> float:
    total, section, digit = 0, 0, 0
    for ch in s:
        if ch in _ZH_DIGITS:
            digit = _ZH_DIGITS[ch]
        else:
            unit = _ZH_UNITS[ch]
            if unit >= 10_000:
                total += (section + digit) * unit
                section, digit = 0, 0
            else:
                section += (digit or 1) * unit
                digit = 0
    return float(total + section + digit)


def numbers(text: str, words: list[str]) -> tuple[float, ...]:
    found = [float(m.replace(",", "").replace("，", "")) for m in _DIGITS.findall(text)]
    found += [float(_WORD_NUMBERS[w]) for i, w in enumerate(words) if w in _WORD_NUMBERS
              and not (w == "one" and i and words[i - 1] in _ONE_AS_PRONOUN)]
    for m in _ZH_NUMBER.finditer(text):
        s = m.group()
        if s in ("一", "万", "千", "百", "十", "亿"):
            continue
        found.append(_zh_value(s))
    return tuple(sorted(found))


# --- vocabulary classes: units, direction, scope, negation -------------------------------------
def _classes(table: dict[str, tuple[str, ...]]) -> dict[str, str]:
    return {word: cls for cls, words in table.items() for word in words}


_UNIT_WORDS = _classes({
    "km": ("km", "kms", "kilometer", "kilometers", "kilometre", "kilometres", "公里", "千米"),
    "mile": ("mile", "miles", "mi", "英里"), "m": ("meter", "meters", "metre", "metres", "米"),
    "cm": ("cm", "centimeter", "centimeters", "centimetre", "厘米"), "mm": ("mm", "millimeter", "毫米"),
    "inch": ("inch", "inches", "in.", "英寸"), "ft": ("ft", "foot", "feet", "英尺"), "yard": ("yard", "yards", "码"),
    "kg": ("kg", "kgs", "kilogram", "kilograms", "kilo", "kilos", "公斤", "千克"),
    "g": ("gram", "grams", "克"), "lb": ("lb", "lbs", "pound", "pounds", "磅"), "oz": ("oz", "ounce", "ounces", "盎司"),
    "ton": ("ton", "tons", "tonne", "tonnes", "吨"), "l": ("liter", "liters", "litre", "litres", "升"),
    "ml": ("ml", "milliliter", "milliliters", "毫升"), "gal": ("gallon", "gallons", "加仑"),
    "c": ("celsius", "°c", "℃", "摄氏", "摄氏度"), "f": ("fahrenheit", "°f", "℉", "华氏", "华氏度"),
    "k": ("kelvin", "开尔文"),
    "usd": ("usd", "dollar", "dollars", "$", "美元", "美金"), "eur": ("eur", "euro", "euros", "€", "欧元"),
    "cny": ("cny", "rmb", "yuan", "¥", "元", "人民币", "块"), "gbp": ("gbp", "sterling", "£", "英镑"),
    "jpy": ("jpy", "yen", "日元"),
    "s": ("second", "seconds", "sec", "secs", "秒", "秒钟"), "min": ("minute", "minutes", "mins", "分钟"),
    "h": ("hour", "hours", "hr", "hrs", "小时", "钟头"), "day": ("day", "days", "天", "日"),
    "week": ("week", "weeks", "周", "星期", "礼拜"), "month": ("month", "months", "个月"),
    "year": ("year", "years", "年"),
    "kb": ("kb", "kilobyte", "kilobytes"), "mb": ("mb", "megabyte", "megabytes", "兆"),
    "gb": ("gb", "gigabyte", "gigabytes"), "tb": ("tb", "terabyte", "terabytes"),
    "pct": ("percent", "%", "％", "百分之", "百分比"), "mph": ("mph",), "kmh": ("km/h", "kph"),
    "w": ("watt", "watts", "瓦"), "kwh": ("kwh", "千瓦时"), "v": ("volt", "volts", "伏"),
})
# Short unit symbols only count right after a number ("5 m", "3g"), else they are words.
_UNIT_AFTER_NUMBER = re.compile(r"\d\s*(m|g|l|s|h|k|t|c|f|°c|°f)\b", re.IGNORECASE)
_SHORT_UNITS = {"m": "m", "g": "g", "l": "l", "s": "s", "h": "h", "k": "k", "t": "ton", "c": "c", "f": "f",
                "°c": "c", "°f": "f"}

_DIRECTION_WORDS = _classes({
    "toggle+": ("enable", "enabled", "enabling", "activate", "activated", "启用", "开启", "打开", "激活", "turn_on",
                "switch_on"),
    "toggle-": ("disable", "disabled", "disabling", "deactivate", "deactivated", "禁用", "关闭", "停用", "关掉",
                "turn_off", "switch_off"),
    "amount+": ("increase", "increasing", "raise", "grow", "more", "增加", "提高", "增大", "上涨", "涨"),
    "amount-": ("decrease", "decreasing", "reduce", "lower", "shrink", "less", "fewer", "减少", "降低", "减小",
                "下降", "跌"),
    "extreme+": ("max", "maximum", "largest", "biggest", "highest", "most", "longest", "最大", "最多", "最高",
                 "最长"),
    "extreme-": ("min", "minimum", "smallest", "lowest", "least", "shortest", "最小", "最少", "最低", "最短"),
    "set+": ("add", "insert", "install", "include", "添加", "增加", "插入", "安装", "包含"),
    "set-": ("remove", "delete", "drop", "uninstall", "exclude", "删除", "移除", "卸载", "排除"),
    "transfer+": ("upload", "import", "push", "send", "上传", "导入", "推送", "发送"),
    "transfer-": ("download", "export", "pull", "receive", "下载", "导出", "拉取", "接收"),
    "crypt+": ("encrypt", "encryption", "compress", "encode", "加密", "压缩", "编码"),
    "crypt-": ("decrypt", "decryption", "decompress", "decode", "解密", "解压", "解码"),
    "trade+": ("buy", "purchase", "买", "购买"), "trade-": ("sell", "sale", "卖", "出售"),
    "time+": ("after", "later", "since", "后", "之后", "以后"),
    "time-": ("before", "earlier", "until", "前", "之前", "以前"),
    "order+": ("ascending", "increasing_order", "升序"), "order-": ("descending", "decreasing_order", "降序"),
    "lock+": ("lock", "locked", "锁定", "上锁"), "lock-": ("unlock", "unlocked", "解锁", "解除锁定"),
    "run+": ("start", "launch", "启动", "开始"), "run-": ("stop", "kill", "terminate", "停止", "终止", "结束"),
    "access+": ("allow", "permit", "grant", "允许", "授权"), "access-": ("deny", "block", "forbid", "revoke",
                                                                        "拒绝", "阻止", "禁止", "撤销"),
    "vert+": ("above", "over", "upper", "higher", "以上", "上面"), "vert-": ("below", "under", "lower", "以下",
                                                                          "下面"),
    "temp+": ("hot", "warm", "warmer", "hotter", "hottest", "warmest", "热", "暖"),
    "temp-": ("cold", "cool", "colder", "cooler", "coldest", "coolest", "冷", "凉"),
    "side+": ("left", "左"), "side-": ("right", "右"),
    "compass_n": ("north", "northern", "北"), "compass_s": ("south", "southern", "南"),
    "compass_e": ("east", "eastern", "东"), "compass_w": ("west", "western", "西"),
    "pro+": ("advantages", "advantage", "pros", "优点", "优势"),
    "pro-": ("disadvantages", "disadvantage", "cons", "drawbacks", "缺点", "劣势"),
    "cmp+": ("faster", "cheaper", "safer", "更快", "更便宜"),
    "cmp-": ("slower", "pricier", "更慢", "更贵"),
})

_SCOPE_WORDS = _classes({
    "all": ("all", "every", "each", "entire", "whole", "everything", "everyone", "everybody",
            "所有", "全部", "每个", "每", "整个", "各", "一切"),
    "some": ("some", "several", "few", "一些", "部分", "几个", "某些"),
    "only": ("only", "just", "solely", "仅", "只", "仅仅", "唯一", "只有"),
    "first": ("first", "initial", "第一", "首个", "首次", "第一个"),
    "last": ("last", "final", "最后", "最后一个", "末尾"),
    "any": ("any", "anyone", "anybody", "anything", "任何", "任意"),
    "both": ("both", "两者", "两个都"),
    "average": ("average", "平均"),
    "total": ("total", "overall", "altogether", "总共", "总计", "一共", "总"),
})

_NEGATION = re.compile(r"\b(?:not|no|never|none|nothing|nobody|neither|nor|cannot|without|unable|nowhere)\b"
                       r"|n't\b")
_ZH_NEGATION = re.compile(r"不|没|无|未|别|非|勿|莫|否")
# questions of the form A-not-A (是不是, 能不能, 有没有) and 是否/能否 ask, they do not deny
_ZH_NOT_NEGATION = re.compile(r"(.)[不没]\1|是否|能否|可否|与否|要否|不同|无论|不管|非常|无线|别人|别的|区别"
                              r"|[不没](?=\s*[?？]|\s*$)")  # 能调休不？: a closing 不 asks, like 吗
# question phrases that name a unit without measuring in it ("what year", "哪一年")
_QUESTION_UNITS = re.compile(r"\b(?:what|which) (?:year|day|month|time)\b|哪一?年|哪一?天|几点|什么时候")

# --- words -----------------------------------------------------------------------------------
_LATIN_WORD = re.compile(r"[A-Za-z][A-Za-z0-9+#]*(?:'[A-Za-z]+)?(?:\.[A-Za-z0-9]+)*")
_TOKEN = re.compile(r"[a-z0-9_°$€£¥℃℉.+#/]+|[\u4e00-\u9fff]")
# Starts at the first digit of a number and never backtracks into it (no unit begins with a digit or
# a space, so giving digits back could not help): linear. Tried at every digit, backtracking,
# it was cubic in a run of digits (2 KB of "1": 0.7 s).
_QUANTITY = re.compile(r"(?<!\d)(\d++(?:\.\d++)?)\s*+([a-z°%$€£¥℃℉/]+|[\u4e00-\u9fff]{1,3})")
_CJK = re.compile(r"[\u4e00-\u9fff]")
_CODE = re.compile(r"`[^`]+`|\b\w+\([^)]*\)|\b\w+_\w+\b|\b\w+\.(?:py|js|ts|go|rs|java|c|cpp|h|json|yaml|yml|toml|"
                   r"md|txt|csv|sql|sh|html|css)\b|(?<!\w)--?[a-z][\w-]*|::|->|=>")
_NO_CALL = "\x00"  # stands for "(" where no call can close: no pattern of _CODE tells the two apart


def _code(text: str) -> frozenset[str]:
    """``_CODE``'s matches, lower-cased. A call ``f(...`` after the last ")" cannot close, yet the
    pattern read to the end of the text from each one (16 KB of "f(": 0.3 s, quadratic); there its
    "(" is swapped for a character the other patterns treat alike, so the same matches come in
    linear time (taken from the original text by position)."""
    close = text.rfind(")") + 1
    safe = text[:close] + text[close:].replace("(", _NO_CALL) if "(" in text[close:] else text
    return frozenset(text[m.start():m.end()].lower() for m in _CODE.finditer(safe))


_SYMBOLS = re.compile(r"[()\[\]{}:;=<>!&|*^~`@\\]")
_PHRASES = (("turn on", "turn_on"), ("switch on", "switch_on"), ("turn off", "turn_off"),
            ("switch off", "switch_off"), ("in ascending order", "ascending"),
            ("in descending order", "descending"))
# Capitalised words that start questions and commands are not names.
_COMMON = frozenset("""a an the what whats what's how hows how's why when where who whom whose which is are was were
do does did can could would should will shall may might must please tell give show explain write list name
describe find convert translate summarize summarise compare make help i im i'm my me we our you your it its
there here this that these those if in on at for to of and or but with from by about as be been being have has
had get set let create add remove delete generate calculate compute define say type use using any some all
is it okay ok hi hello hey yes no not do don't does doesn't can't cannot
""".split())
_EN_FUNCTION = _COMMON | frozenset("""into than then so very much many more most less least also just only
ever even still again out up down over under off one ones thing things way ways someone something anything
need needs want wants like best good better steps step mean means meaning kind sort type common usual happen
they them their he she him her his us
know understand wonder wondering inform advise kindly whether wish appreciate inquire curious
""".split())
# register: verbs and adverbs of a polite request ("I would like to know whether ...") carry no content
_ZH_FUNCTION = frozenset("的了吗呢吧啊呀么是在我你他她它们这那有个和与及或请问一下能可以会要想应该该如何怎样么什"
                         "为谁哪些里中上下来去到对把被给让用从就都也还又很太更最多少几点时候怎办告诉帮助说明解释介绍"
                         "知道需要应当可否啥吗嘛呗之其所以因此但是而且并且如果就是还是或者然后以及关于一个咋")


def _phrases(lowered: str) -> str:
    for phrase, token in _PHRASES:
        lowered = lowered.replace(phrase, token)
    return lowered


def _stem(word: str) -> str:
    word = word.removesuffix("'s")
    if len(word) > 4 and word.endswith("ies"):
        return word[:-3] + "y"
    if len(word) > 3 and word.endswith("s") and not word.endswith(("ss", "us", "is")):
        return word[:-1]
    return word


@dataclass(frozen=True, slots=True)
class Features:
    numbers: tuple[float, ...]
    quantities: frozenset[tuple[float, str]]  # a number and the unit written right after it
    units: frozenset[str]
    negations: int             # how many negations ("支持无理由" holds one, "不支持无理由" two)
    directions: frozenset[str]
    scope: frozenset[str]
    names: frozenset[str]      # lower-cased proper nouns, acronyms, mixed-case terms
    words: frozenset[str]      # every Latin word, lower-cased and stemmed
    content: frozenset[str]    # Latin content words (function words left out)
    code: frozenset[str]
    symbols: str               # the code-like punctuation, in order
    cjk_content: frozenset[str]  # Chinese content characters (function characters left out)
    cjk: bool
    roles: frozenset[tuple[str, str]]  # (direction marker, the content word after it)
    times: frozenset[str]      # the time classes named (yesterday, next month, 上午 ...)
    whole: Features | None = None  # the whole text's, where it holds more than the asking sentence


def extract(text: str) -> Features:
    """The guards' features of the asking sentence (``roles.ask``), with the words of the whole text;
    where the text has more (context, pleasantries), the whole text's features in ``whole``."""
    text = text.replace("’", "'")
    asked = ask(text)
    if asked.strip() == text.strip():
        return _extract(text)
    part, whole = _extract(asked), _extract(text)
    return replace(part, words=whole.words, content=whole.content, cjk_content=whole.cjk_content, whole=whole)


def _extract(text: str) -> Features:
    lowered = _phrases(text.lower())
    latin = _LATIN_WORD.findall(text)
    tokens = set(_TOKEN.findall(lowered)) | {w.lower() for w in latin}
    measured = _QUESTION_UNITS.sub(" ", lowered)
    units = {_UNIT_WORDS[t] for t in set(_TOKEN.findall(measured)) if t in _UNIT_WORDS and len(t) > 1}
    units |= {cls for w, cls in _UNIT_WORDS.items() if (not w.isascii() or not w.isalnum()) and w in measured}
    units |= {_SHORT_UNITS[m.lower()] for m in _UNIT_AFTER_NUMBER.findall(text)}
    quantities = set()
    for value, unit in _QUANTITY.findall(measured):
        cls = _UNIT_WORDS.get(unit) or _SHORT_UNITS.get(unit) or next(
            (c for w, c in _UNIT_WORDS.items() if not w.isascii() and unit.startswith(w)), None)
        if cls is not None:
            quantities.add((float(value), cls))
    directions = {_DIRECTION_WORDS[t] for t in tokens if t in _DIRECTION_WORDS}
    directions |= {c for w, c in _DIRECTION_WORDS.items() if not w.isascii() and w in text}
    scope = {_SCOPE_WORDS[t] for t in tokens if t in _SCOPE_WORDS}
    scope |= {c for w, c in _SCOPE_WORDS.items() if not w.isascii() and w in text}
    zh = _ZH_NOT_NEGATION.sub("", text)
    negations = len(_NEGATION.findall(lowered)) + len(_ZH_NEGATION.findall(zh))
    has_cjk = bool(_CJK.search(text))
    names = set()
    for i, w in enumerate(latin):
        low = w.lower()
        proper = w[0].isupper() and (i > 0 or low not in _COMMON)
        mixed = any(c.isupper() for c in w[1:]) or any(c.isdigit() for c in w)
        if (proper or mixed or has_cjk) and low not in _COMMON and low not in _UNIT_WORDS:
            names.add(_stem(low))
    words = frozenset(_stem(w.lower()) for w in latin)
    words_seen = frozenset(w.lower() for w in latin) - _EN_FUNCTION  # "does" is function, its stem "doe" is not
    content = frozenset(w for w in map(_stem, words_seen) if w not in _EN_FUNCTION and w not in _UNIT_WORDS
                        and w not in _DIRECTION_WORDS and w not in _SCOPE_WORDS and w not in _WORD_NUMBERS)
    code = _code(text)
    symbols = "".join(_SYMBOLS.findall(text))
    cjk_content = frozenset(c for c in _CJK.findall(text) if c not in _ZH_FUNCTION)
    return Features(numbers(lowered, [w.lower() for w in latin]), frozenset(quantities), frozenset(units), negations,
                    frozenset(directions), frozenset(scope), frozenset(names), words, content, code, symbols,
                    cjk_content, has_cjk, arguments(text, lowered, _EN_FUNCTION, _stem), times(text, lowered))


def refusal(a: Features, b: Features) -> str | None:
    """None if the two questions may share an answer, else the guard that refused. Two questions
    that both carry context are compared whole; context only one of them adds is detail around the
    same question (its words still count: the content guard refuses a swapped one)."""
    if a.whole is not None and b.whole is not None:
        return refusal(a.whole, b.whole)
    if a.numbers != b.numbers:
        return "number"
    if a.units != b.units or a.quantities != b.quantities:
        return "unit"
    if a.times != b.times:
        return "time"
    if a.negations != b.negations:
        return "negation"
    if a.directions != b.directions and _direction_differs(a, b):
        return "direction"
    if swapped_roles(a.roles, a.words | a.cjk_content, b.roles, b.words | b.cjk_content):
        return "direction"
    if a.scope != b.scope:
        return "scope"
    if not (covered(a.names, b.words) and covered(b.names, a.words)):
        return "entity"
    if a.code != b.code or a.symbols != b.symbols:
        return "code"
    if swapped(a.content, b.content):
        return "content"
    if a.cjk and b.cjk and swapped(a.cjk_content, b.cjk_content):
        return "content"
    return None


def _direction_differs(a: Features, b: Features) -> bool:
    """Opposite poles of one scale (enable/disable) differ; a direction word only one question
    holds differs where the other holds a content word in its place (remove -> eliminate), not
    where it only lacks it (context, a pleasantry: "am I right?")."""
    if poles_conflict(a.directions, b.directions):
        return True
    a_more, b_more = a.directions - b.directions, b.directions - a.directions
    if a_more and b_more:  # one direction word swapped for another
        return True
    return (bool(a_more) and _adds(b, a)) or (bool(b_more) and _adds(a, b))


def _adds(a: Features, b: Features) -> bool:
    """a holds a content word b has no near twin of."""
    if a.cjk and b.cjk and a.cjk_content - b.cjk_content:
        return True
    return bool(extra(a.content, b.content))
