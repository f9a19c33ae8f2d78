"""PII rules: each kind on real-shaped positives and on look-alikes that must stay."""

import pytest

from llmesh.gateway.domain.guards.pii import PiiMasker, Placeholders, restore
from llmesh.gateway.domain.guards.pii_rules import PiiKind, card_issuer_known, cn_id_valid, luhn_valid
from llmesh.types import Message


@pytest.fixture(scope="module")
def masker() -> PiiMasker:
    return PiiMasker()


def kinds_found(masker: PiiMasker, text: str) -> list[tuple[str, str]]:
    return [(h.kind.value, text[h.start:h.end]) for h in masker.scan(text)]


def assert_masked(masker: PiiMasker, value: str, kind: str) -> None:
    for text in (value, f"see {value} here", f"联系{value}，谢谢", f"({value})", f"{value}."):
        hits = kinds_found(masker, text)
        assert hits == [(kind, value)], (text, hits)


def assert_kept(masker: PiiMasker, text: str) -> None:
    masked = masker.mask(f"note: {text} end")
    assert masked.text == f"note: {text} end", masked.text
    assert not masked.found


@pytest.mark.parametrize("value", [
    "bob@example.com", "Bob.Smith+tag@mail.example.co.uk", "x_y-z%1@sub-domain.example.io", "zhang.san@qq.com",
])
def test_email(masker, value):
    assert_masked(masker, value, "email")


@pytest.mark.parametrize("text", [
    "user@localhost", "@handle", "a@b", "name [at] example dot com", "foo@bar.c", "email@123.123.123.123x",
])
def test_email_look_alikes(masker, text):
    assert_kept(masker, text)


@pytest.mark.parametrize("value", [
    "13812345678", "19912345678", "+86 13812345678", "+8613812345678", "0086 138 1234 5678", "138-1234-5678",
    "138 1234 5678", "010-12345678", "0755-1234567",
    "(415) 555-2671", "415-555-2671", "415.555.2671", "1-800-555-0199", "+1 415 555 2671", "+1 (415) 555-2671",
    "+44 20 7946 0958", "+49 30 901820", "0044 20 7946 0958", "+33 1 42 68 53 00",
])
def test_phone(masker, value):
    assert_masked(masker, value, "phone")


@pytest.mark.parametrize("text", [
    "12345678901",            # 11 digits, but a Chinese mobile starts 13-19
    "11812345678",            # 11 is no mobile prefix
    "123-456-7890",           # North American area codes never start with 1
    "555-123-4567",           # nor exchanges
    "2024-01-15", "2024/01/15", "15.01.2024", "10:30:00", "2024-01-15T10:30:00Z",
    "1700000000", "1700000000000",   # unix timestamps (s, ms)
    "order #202401150001", "ORD-20240115-0001", "3.14159265", "1,234,567.89", "v1.2.3", "+5", "1 2 3 4 5",
    "abc13812345678", "13812345678901",  # glued to letters, or part of a longer number
])
def test_phone_look_alikes(masker, text):
    assert_kept(masker, text)


# GB 11643's own examples, and one built for a 2000s birth date
VALID_CN_IDS = ["11010519491231002X", "440524188001010014", "110101200001011232"]


def test_cn_id_check_digit():
    for value in VALID_CN_IDS:
        assert cn_id_valid(value), value
    for value in VALID_CN_IDS:
        for wrong in "0123456789X":
            if wrong != value[-1]:
                assert not cn_id_valid(value[:-1] + wrong)


@pytest.mark.parametrize("value", VALID_CN_IDS + ["11010519491231002x"])
def test_cn_id(masker, value):
    assert_masked(masker, value, "national_id")


@pytest.mark.parametrize("text", [
    "110105194912310021",     # wrong check digit
    "110105194902300028",     # 30 February
    "110105294912310026",     # born in 2949
    "910105194912310023",     # region code 9
    "11010519491231002",      # 17 characters
    "1101051949123100211",    # 19 digits (and not a card: starts with 1)
])
def test_cn_id_look_alikes(masker, text):
    assert_kept(masker, text)


@pytest.mark.parametrize("value", ["536-22-1234", "123-45-6789", "772-01-0001"])
def test_us_ssn(masker, value):
    assert_masked(masker, value, "national_id")


@pytest.mark.parametrize("text", ["000-12-3456", "666-12-3456", "900-12-3456", "987-65-4321", "123-00-4567",
                                  "123-45-0000", "1234-56-7890", "12-345-6789", "123456789"])
def test_us_ssn_look_alikes(masker, text):
    assert_kept(masker, text)


@pytest.mark.parametrize("value", [
    "4111111111111111", "4111 1111 1111 1111", "4111-1111-1111-1111", "4012888888881881",
    "5555555555554444", "2223003122003222", "378282246310005", "3782 822463 10005", "6011111111111117",
    "3530111333300000", "6200000000000005", "6212 3456 7890 1234 569", "30569309025904", "4222222222222",
])
def test_bank_card(masker, value):
    assert luhn_valid("".join(c for c in value if c.isdigit()))
    assert_masked(masker, value, "bank_card")


@pytest.mark.parametrize("text", [
    "4111111111111112",        # Luhn fails
    "4111 1111 1111 1112",
    "1234567812345670",        # Luhn passes, but no network starts with 1
    "9999999999999995",        # Luhn passes, no network starts with 9
    "4111 1111-1111 1111",     # mixed separators
    "4111111111111111111111",  # 22 digits
    "411111111111",            # 12 digits
])
def test_bank_card_look_alikes(masker, text):
    assert_kept(masker, text)


def test_card_issuers():
    assert card_issuer_known("4000") and card_issuer_known("5100") and card_issuer_known("2221")
    assert not card_issuer_known("5900") and not card_issuer_known("2100") and not card_issuer_known("3100")
    assert not card_issuer_known("7000") and not card_issuer_known("1000")


@pytest.mark.parametrize("value", [
    "192.168.1.1", "8.8.8.8", "10.0.0.255", "255.255.255.255", "1.2.3.4",  # a bare dotted quad is an address
    "2001:db8::1", "2001:0db8:85a3:0000:0000:8a2e:0370:7334", "fe80::1%eth0", "::1", "::ffff:192.0.2.1",
])
def test_ip(masker, value):
    assert_masked(masker, value, "ip")


@pytest.mark.parametrize("text", [
    "999.1.1.1", "256.256.256.256", "1.2.3", "1.2.3.4.5", "v1.2.3.4", "01.02.03.04", "12:30:45",
    "std::vector", "Foo::Bar", "00:1A:2B:3C:4D:5E", "1:2", "2001:db8:::1",
])
def test_ip_look_alikes(masker, text):
    assert_kept(masker, text)


JWT = ("eyJhbGciOiJIUzI1NiIsInR5cCI6IkpXVCJ9.eyJzdWIiOiIxMjM0NTY3ODkwIiwibmFtZSI6IkpvaG4gRG9lIiwiaWF0IjoxNTE2MjM5MDIyfQ"
       ".SflKxwRJSMeKKF2QT4fwpMeJf36POk6yJV_adQssw5c")
PEM = "-----BEGIN RSA PRIVATE KEY-----\nMIIEowIBAAKCAQEA7yH2\nq3x+/9Z==\n-----END RSA PRIVATE KEY-----"


@pytest.mark.parametrize("value", [
    "sk-proj-abcdefghijklmnopqrstuvwxyz0123456789", "sk-ant-api03-AbCdEfGhIjKlMnOpQrStUv",
    "sk_live_4eC39HqLyjWDarjtT1zdp7dc",
    "AKIAIOSFODNN7EXAMPLE", "ghp_" + "a1B2" * 9, "github_pat_" + "x" * 60, "glpat-abcdefghij0123456789",
    "xoxb-1234567890-abcdefghij", "AIza" + "B" * 35, "hf_" + "q" * 34, JWT, PEM,
    "-----BEGIN PRIVATE KEY-----\nMIIEvQIBADANBg\n-----END PRIVATE KEY-----",
])
def test_secret(masker, value):
    assert_masked(masker, value, "secret")


@pytest.mark.parametrize("text", [
    "sk-learn", "scikit-learn", "task-12345678901234567890", "AKIA", "AKIAshort", "ghp_short", "hf_hub_download",
    "eyJhbGciOi.eyJzdWIi.abc", "eyJub3QganNvbg.eyJzdWIiOiIxIn0.sig",  # too short; header is not a JSON object
    "-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----",  # certificates are public
])
def test_secret_look_alikes(masker, text):
    assert_kept(masker, text)


def test_unterminated_private_key_is_masked_to_the_end(masker):
    masked = masker.mask("key: -----BEGIN EC PRIVATE KEY-----\nMHcCAQEE")
    assert masked.text == "key: [SECRET_1]"


def test_same_value_same_placeholder_and_round_trip(masker):
    text = ("Mail bob@example.com or BOB@EXAMPLE.COM; call 13812345678 or +86 138 1234 5678; "
            "card 4111 1111 1111 1111 = 4111111111111111; from 10.0.0.1 and alice@example.org.")
    masked = masker.mask(text)
    assert masked.text == ("Mail [EMAIL_1] or [EMAIL_1]; call [PHONE_1] or [PHONE_1]; "
                           "card [CARD_1] = [CARD_1]; from [IP_1] and [EMAIL_2].")
    assert masked.counts == {"email": 3, "phone": 2, "bank_card": 2, "ip": 1}
    assert masked.found["[EMAIL_1]"] == "bob@example.com"  # the first spelling seen
    assert restore(masked.text, masked.found) == text.replace("BOB@EXAMPLE.COM", "bob@example.com").replace(
        "+86 138 1234 5678", "13812345678").replace("4111111111111111", "4111 1111 1111 1111")


def test_round_trip_is_exact_for_distinct_values(masker):
    text = "我是张三，身份证11010519491231002X，手机13812345678，邮箱zhangsan@163.com，IP 2001:db8::8a2e:370:7334。"
    masked = masker.mask(text)
    assert "11010519491231002X" not in masked.text and "13812345678" not in masked.text
    assert restore(masked.text, masked.found) == text


def test_placeholder_text_in_the_input_is_never_handed_out(masker):
    text = "The doc says [EMAIL_1] and [PHONE_2]; mine is me@example.com, tel 13812345678 and 13912345678."
    masked = masker.mask(text)
    assert masked.text == ("The doc says [EMAIL_1] and [PHONE_2]; mine is [EMAIL_2], tel [PHONE_1] and [PHONE_3].")
    assert restore(masked.text, masked.found) == text


def test_chat_shares_one_mapping(masker):
    chat = [Message("system", "Be brief."), Message("user", "I am bob@example.com"),
            Message("assistant", ""), Message("user", "again: bob@example.com, and eve@example.com")]
    masked = masker.mask_messages(chat)
    assert [m.role for m in masked.messages] == ["system", "user", "assistant", "user"]
    assert masked.messages[1].content == "I am [EMAIL_1]"
    assert masked.messages[3].content == "again: [EMAIL_1], and [EMAIL_2]"
    assert masked.counts == {"email": 3}
    assert [restore(m.content, masked.found) for m in masked.messages] == [m.content for m in chat]


def test_only_enabled_kinds_are_masked():
    text = "bob@example.com 13812345678 192.168.0.1 AKIAIOSFODNN7EXAMPLE"
    assert PiiMasker(["email", "ip"]).mask(text).text == "[EMAIL_1] 13812345678 [IP_1] AKIAIOSFODNN7EXAMPLE"
    assert PiiMasker([]).mask(text).text == text
    with pytest.raises(ValueError):
        PiiMasker(["passport"])


def test_a_failed_check_lets_another_rule_match(masker):
    # shaped like an ID (region 621234, born 1990-01-01) with a wrong check digit: a UnionPay card
    card = "621234199001011239"
    assert luhn_valid(card) and not cn_id_valid(card)
    assert kinds_found(masker, f"pay {card} now") == [("bank_card", card)]


def test_restore_leaves_unknown_placeholders_and_other_brackets():
    mapping = {"[EMAIL_1]": "bob@example.com"}
    assert (restore("to [EMAIL_1], not [EMAIL_2] [1] [EMAIL_1", mapping)
            == "to bob@example.com, not [EMAIL_2] [1] [EMAIL_1")
    assert restore("no brackets", mapping) == "no brackets"


def test_placeholders_shared_with_later_text():
    placeholders = Placeholders()
    masker = PiiMasker()
    first = masker.mask("a@example.com", placeholders)
    second = masker.mask("b@example.com and a@example.com", placeholders)
    assert first.text == "[EMAIL_1]" and second.text == "[EMAIL_2] and [EMAIL_1]"
    assert second.found == {"[EMAIL_1]": "a@example.com", "[EMAIL_2]": "b@example.com"}
    assert PiiKind.EMAIL in masker.kinds


def test_overlapping_matches_are_masked_as_one(masker):
    # the card's last group also starts an IPv6 address: neither may leave a piece in the clear
    text = "pay 4111 1111 1111 1111:abcd::1 now"
    masked = masker.mask(text)
    assert masked.text == "pay [CARD_1] now"
    assert restore(masked.text, masked.found) == text


def test_a_phone_does_not_swallow_the_hour_of_a_time(masker):
    assert masker.mask("call +44 20 7946 0958 12:30 today").text == "call [PHONE_1] 12:30 today"


def test_ipv6_after_a_label_and_colon(masker):
    assert masker.mask("IP:2001:db8::1, note:fe80::1").text == "IP:[IP_1], note:[IP_2]"
    assert masker.mask("de:ad:be:ef and 1:2:3:4:5:6:7:8:9").text == "de:ad:be:ef and 1:2:3:4:5:6:7:8:9"


def test_address_with_port(masker):
    masked = masker.mask("connect to 192.168.1.1:8080 or [2001:db8::1]:443").text
    assert masked == "connect to [IP_1]:8080 or [[IP_2]]:443"


@pytest.mark.parametrize("text, phones", [
    # the international form's greedy groups ran into the next number: too many digits, and the
    # "+1 " was left in the clear while the rest matched other rules
    ("+1 (200) 200-0000 13000000000", ["+1 (200) 200-0000", "13000000000"]),
    ("+1 415 555 2671 415 555 2671 x", ["+1 415 555 2671", "415 555 2671"]),
    ("+1 415 555 2671 13812345678", ["+1 415 555 2671", "13812345678"]),
    ("+44 20 7946 0958 1234 5678 9", ["+44 20 7946 0958"]),  # the longest when nothing follows
])
def test_a_phone_that_runs_into_the_next_number_is_cut_where_a_phone_ends(masker, text, phones):
    assert kinds_found(masker, text) == [("phone", p) for p in phones]
    assert "+" not in masker.mask(text).text
