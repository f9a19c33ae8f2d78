"""PII masking's rules: the kinds, their placeholder labels, one regular expression per
rule, and each rule's check (a real date, a check digit, Luhn, a parseable address),
which also gives the normalised value that equal matches share a placeholder by. The
masker (``pii``) says where the rules are tried and how matches become placeholders."""

from __future__ import annotations

import base64
import binascii
import datetime
import enum
import ipaddress
import re
from collections.abc import Callable


class PiiKind(str, enum.Enum):
    EMAIL = "email"
    PHONE = "phone"
    NATIONAL_ID = "national_id"
    BANK_CARD = "bank_card"
    IP = "ip"
    SECRET = "secret"


LABELS: dict[PiiKind, str] = {
    PiiKind.EMAIL: "EMAIL", PiiKind.PHONE: "PHONE", PiiKind.NATIONAL_ID: "ID",
    PiiKind.BANK_CARD: "CARD", PiiKind.IP: "IP", PiiKind.SECRET: "SECRET",
}
PLACEHOLDER = re.compile(r"\[(?:EMAIL|PHONE|ID|CARD|IP|SECRET)_\d+\]")

# Boundaries for numbers: no ASCII word character (or @ +) right before, and not the tail
# of a longer dotted/dashed number; nothing word-like after, and not continuing with .5 or -5.
# Chinese characters are boundaries (re.ASCII), so "手机13812345678" matches.
_NB = r"(?<![A-Za-z0-9_@+])(?<!\d[.\-/])"
_NA = r"(?![A-Za-z0-9_@]|[.\-/]\d)"
_NA_PHONE = r"(?![A-Za-z0-9_@]|[.\-/:]\d)"  # nor the hour of a time: "+44 20 7946 0958 12:30"
_AFTER_PHONE = re.compile(_NA_PHONE, re.ASCII)

# A private-key block: its BEGIN line, then up to its END line or the end of the text. The masker
# finds the BEGIN line, then the first END line after it (two searches, not a lazy [\s\S]*?).
PEM_BEGIN = r"-----BEGIN[A-Z0-9 ]{0,40}PRIVATE\ KEY-----"
PEM_END = r"-----END[A-Z0-9 ]{0,40}PRIVATE\ KEY-----"

# (rule name, kind, pattern). Order matters where two rules can match at one place.
_RULES: tuple[tuple[str, PiiKind, str], ...] = (
    ("pem_key", PiiKind.SECRET, rf"{PEM_BEGIN}[\s\S]*?(?:{PEM_END}|\Z)"),  # for reference: scanned as above
    ("api_key", PiiKind.SECRET,
     r"(?<![A-Za-z0-9_\-])(?:"
     r"sk-(?:ant-|proj-|svcacct-)?[A-Za-z0-9_\-]{20,}"
     r"|[sr]k_(?:live|test)_[A-Za-z0-9]{16,}"
     r"|(?:AKIA|ASIA)[0-9A-Z]{16}"
     r"|gh[pousr]_[A-Za-z0-9]{36,}|github_pat_[A-Za-z0-9_]{40,}"
     r"|glpat-[A-Za-z0-9_\-]{20,}"
     r"|xox[abposr]-[A-Za-z0-9\-]{10,}"
     r"|AIza[0-9A-Za-z_\-]{35}"
     r"|hf_[A-Za-z0-9]{30,}"
     r")(?![A-Za-z0-9_\-])"),
    ("jwt", PiiKind.SECRET,
     r"(?<![A-Za-z0-9_\-.])eyJ[A-Za-z0-9_\-]{8,}\.eyJ[A-Za-z0-9_\-]{8,}\.[A-Za-z0-9_\-]*(?![A-Za-z0-9_\-]|\.[A-Za-z0-9_\-])"),
    ("email", PiiKind.EMAIL,
     r"(?<![A-Za-z0-9_.%+\-])[A-Za-z0-9_%+\-][A-Za-z0-9_.%+\-]{0,63}"
     r"@(?:[A-Za-z0-9](?:[A-Za-z0-9\-]{0,61}[A-Za-z0-9])?\.)+[A-Za-z]{2,24}(?![A-Za-z0-9_\-]|\.[A-Za-z0-9])"),
    ("ipv4", PiiKind.IP, _NB + r"(?<!\d\.)(?:\d{1,3}\.){3}\d{1,3}" + _NA),
    ("ipv6", PiiKind.IP,
     r"(?:(?<![A-Za-z0-9_:.])|(?<=[A-Za-z]:))(?=[0-9A-Fa-f]{0,4}:[0-9A-Fa-f]{0,4}:)(?:[0-9A-Fa-f]{1,4}|:)"
     r"(?:[0-9A-Fa-f]{0,4}:){1,7}(?:(?:\d{1,3}\.){3}\d{1,3}|[0-9A-Fa-f]{1,4})?"
     r"(?:%[A-Za-z0-9]{1,15})?(?![A-Za-z0-9_:]|\.\d)"),
    ("cn_id", PiiKind.NATIONAL_ID,
     _NB + r"[1-8]\d{5}(?:18|19|20)\d{2}(?:0[1-9]|1[0-2])(?:0[1-9]|[12]\d|3[01])\d{3}[\dXx]" + _NA),
    ("bank_card", PiiKind.BANK_CARD,
     _NB + r"(?:\d{13,19}"
     r"|\d{4}(?P<cs>[ \-])\d{4}(?P=cs)\d{4}(?P=cs)\d{1,4}(?:(?P=cs)\d{1,3})?"
     r"|\d{4}(?P<as>[ \-])\d{6}(?P=as)\d{4,5})" + _NA),
    ("us_ssn", PiiKind.NATIONAL_ID,
     _NB + r"(?!000|666|9\d\d)\d{3}-(?!00)\d{2}-(?!0000)\d{4}" + _NA),
    ("phone", PiiKind.PHONE,
     _NB + r"(?:"
     r"(?:(?:\+|00)86[ \-]?)?1[3-9]\d(?:[ \-]?\d{4}){2}"
     r"|(?:\+|00)[1-9]\d{0,2}(?:[ .\-]?(?:\(\d{1,4}\)|\d{1,4})){2,6}"
     r"|(?:1[ .\-])?(?:\([2-9]\d{2}\)[ .\-]?|[2-9]\d{2}[ .\-])[2-9]\d{2}[ .\-]\d{4}"
     r"|0\d{2,3}-\d{7,8}"
     r")" + _NA_PHONE),
)

_CN_ID_WEIGHTS = (7, 9, 10, 5, 8, 4, 2, 1, 6, 3, 7, 9, 10, 5, 8, 4, 2)
_CN_ID_CHECK = "10X98765432"


def cn_id_valid(value: str) -> bool:
    """18-character resident ID: a real birth date and the ISO 7064 MOD 11-2 check digit."""
    if len(value) != 18 or not value[:17].isdigit():
        return False
    try:
        born = datetime.date(int(value[6:10]), int(value[10:12]), int(value[12:14]))
    except ValueError:
        return False
    if born > datetime.date.today():
        return False
    total = sum(int(d) * w for d, w in zip(value[:17], _CN_ID_WEIGHTS))
    return _CN_ID_CHECK[total % 11] == value[17].upper()


def luhn_valid(digits: str) -> bool:
    total = 0
    for i, ch in enumerate(reversed(digits)):
        d = ord(ch) - 48
        if i % 2:
            d = d * 2 - 9 if d > 4 else d * 2
        total += d
    return total % 10 == 0


def card_issuer_known(digits: str) -> bool:
    """A major network's prefix (IIN ranges): Visa 4; Mastercard 51-55, 2221-2720; Mir 2200-2204;
    Amex 34, 37; Diners 300-305, 36, 38, 39; JCB 3528-3589; Discover 6011, 644-649, 65;
    UnionPay 62; Maestro 50, 56-58, 67, 6304."""
    two, four = int(digits[:2]), int(digits[:4])
    first = digits[0]
    if first == "4":
        return True
    if first == "5":
        return 50 <= two <= 58
    if first == "2":
        return 2221 <= four <= 2720 or 2200 <= four <= 2204
    if first == "3":
        return two in (34, 36, 37, 38, 39) or 300 <= int(digits[:3]) <= 305 or 3528 <= four <= 3589
    if first == "6":
        return (four == 6011 or 644 <= int(digits[:3]) <= 649 or two in (62, 65, 67) or four == 6304)
    return False


_SEPARATORS = str.maketrans("", "", " -.()+")


def _digits(text: str) -> str:
    """The digits of a matched number (its other characters are separators)."""
    return text.translate(_SEPARATORS)


def _card(text: str) -> str | None:
    digits = _digits(text)
    if 13 <= len(digits) <= 19 and card_issuer_known(digits) and luhn_valid(digits):
        return digits
    return None


def _phone(text: str) -> str | None:
    digits = _digits(text)
    international = text[0] == "+" or text.startswith("00")
    if text.startswith("00"):
        digits = digits[2:]
    if not 8 <= len(digits) <= 15:
        return None
    if international and digits.startswith("86") and len(digits) == 13 and digits[2] == "1":
        return digits[2:]  # +86 138... and 138... are one number
    return "+" + digits if international else digits


def _ipv4(text: str) -> str | None:
    try:
        ipaddress.IPv4Address(text)  # refuses parts over 255 and leading zeros
    except ValueError:
        return None
    return text  # a valid dotted quad is already canonical


def _ipv6(text: str) -> str | None:
    try:
        return ipaddress.IPv6Address(text).compressed
    except ValueError:
        return None


def _jwt(text: str) -> str | None:
    head = text.split(".", 1)[0]
    try:
        decoded = base64.urlsafe_b64decode(head + "=" * (-len(head) % 4))
    except (binascii.Error, ValueError):
        return None
    return text if decoded.startswith(b"{") and decoded.rstrip().endswith(b"}") else None


# Each rule's check: returns the normalised value (equal values share a placeholder) or None.
_CHECKS: dict[str, Callable[[str], str | None]] = {
    "pem_key": lambda t: t,
    "api_key": lambda t: t,
    "jwt": _jwt,
    "email": lambda t: t.lower(),
    "ipv4": _ipv4,
    "ipv6": _ipv6,
    "cn_id": lambda t: t.upper() if cn_id_valid(t) else None,
    "bank_card": _card,
    "us_ssn": _digits,
    "phone": _phone,
}
