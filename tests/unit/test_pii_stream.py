"""Streaming PII: masking the model's output and restoring placeholders, delta by delta."""

import random
import zlib

import pytest

from llmesh.gateway.domain.guards.pii import PiiMasker, Placeholders
from llmesh.gateway.domain.guards.pii_stream import StreamMasker, StreamRestorer
from llmesh.types import Message

PEM = "-----BEGIN RSA PRIVATE KEY-----\nMIIEowIBAAKCAQEA7yH2\nq3x+/9Z==\n-----END RSA PRIVATE KEY-----"
TEXTS = [
    "Sure! Write to bob.smith@example.com or call +1 (415) 555-2671, or 13812345678.",
    "我的邮箱是zhangsan@163.com，手机+86 138 1234 5678，身份证11010519491231002X。",
    "Card 4111 1111 1111 1111 expires soon; the server is at 192.168.10.20 and 2001:db8::1.",
    "Here is the key:\n" + PEM + "\nKeep it safe. Also AKIAIOSFODNN7EXAMPLE and sk-proj-abcdefghijklmnopqrstuvwxyz012.",
    "Nothing personal here, just version 1.2.3 released on 2024-01-15 at 10:30:00 with 12 fixes.",
    "SSN 536-22-1234, landline 010-12345678, 1-800-555-0199; numbers 1 2 3 4 5 6 7 8 9 10 and done",
]


def pieces(text: str, rng: random.Random) -> list[str]:
    out, i = [], 0
    while i < len(text):
        n = rng.choice([1, 1, 2, 3, 5, 8, 13])
        out.append(text[i:i + n])
        i += n
    return out


def stream_mask(masker: PiiMasker, parts: list[str], **kw) -> tuple[str, list[str], StreamMasker]:
    stream = StreamMasker(masker, **kw)
    emitted = [stream.feed(p) for p in parts]
    emitted.append(stream.flush())
    return "".join(emitted), emitted, stream


@pytest.mark.parametrize("text", TEXTS)
def test_any_split_masks_like_the_whole_text(text):
    masker = PiiMasker()
    whole = masker.mask(text)
    rng = random.Random(zlib.crc32(text.encode()))
    for _ in range(30):
        out, emitted, stream = stream_mask(masker, pieces(text, rng))
        assert out == whole.text
        assert stream.counts == whole.counts
        assert dict(stream.found) == dict(whole.found)
    for original in whole.found.values():
        assert all(original not in chunk for chunk in emitted)


def test_one_character_at_a_time_never_leaks():
    masker = PiiMasker()
    for text in TEXTS:
        out, emitted, _ = stream_mask(masker, list(text))
        assert out == masker.mask(text).text
        for secret in ("bob.smith", "4111", "13812345678", "MIIEowIBAAKCAQEA7yH2", "AKIAIOSF"):
            assert secret not in out


def test_prose_streams_with_at_most_the_last_word_held():
    stream = StreamMasker(PiiMasker())
    assert stream.feed("The quick brown ") == "The quick brown "
    assert stream.feed("fox jumps") == "fox "
    assert stream.feed(" over") == "jumps "
    assert stream.feed("。中文也一样，") == "over。中文也一样，"
    assert stream.flush() == ""


def test_the_first_token_waits_for_the_second_only_when_it_could_begin_pii():
    """What the answer's masking costs the time to first token (issue 27, bench.vllm): a first
    token that no rule can start goes out with no wait; a first word (SmolLM2's "In", "As",
    "The" on bench.vllm's prompts) waits exactly one token, the next one's leading space, because
    "In@example.com" would be an address; no more than that one token."""
    for first in ("Sure!", "你好，", "**", "\n", "Hi, ", "x="):
        assert StreamMasker(PiiMasker()).feed(first) == first, first
    for first, second, out in (("In", " the", "In "), ("The", " sun", "The "), ("Title:", " A", "Title: "),
                               ("As", ",", "As,")):
        stream = StreamMasker(PiiMasker())
        assert stream.feed(first) == ""
        assert stream.feed(second) == out
    stream = StreamMasker(PiiMasker())
    assert stream.feed("In") == ""
    assert stream.feed("@example.com") == ""
    assert stream.feed(" we") == "[EMAIL_1] "


def test_number_groups_are_held_until_they_cannot_be_a_phone():
    stream = StreamMasker(PiiMasker())
    assert stream.feed("Call +1 ") == "Call "
    assert stream.feed("415 ") == ""
    assert stream.feed("555 ") == ""
    assert stream.feed("2671 now") == "[PHONE_1] "
    assert stream.flush() == "now"


def test_hold_is_bounded_and_a_cut_match_swallows_its_rest():
    stream = StreamMasker(PiiMasker(), max_hold=32)
    key = "sk-" + "a" * 60
    out = stream.feed("token " + key[:40])
    assert out == "token [SECRET_1]"  # the run passed 32 characters: released, masked as it stood
    assert stream.feed(key[40:] + " ok") == " "
    assert stream.flush() == "ok"
    assert stream.found["[SECRET_1]"] == key


def test_a_cut_run_never_rewrites_a_placeholder_from_the_prompt():
    masker = PiiMasker()
    placeholders = Placeholders()
    key = "sk-" + "b" * 40
    masker.mask(f"my key is {key}", placeholders)
    stream = StreamMasker(masker, placeholders, max_hold=32)
    assert stream.feed("echo " + key) == "echo [SECRET_1]"
    assert stream.feed("ccc tail") == " "
    assert placeholders.found["[SECRET_1]"] == key


def test_long_plain_token_is_released_past_the_bound():
    stream = StreamMasker(PiiMasker(), max_hold=16)
    blob = "x" * 40
    assert stream.feed(blob) == blob
    assert stream.feed("y z") == "y "
    assert stream.flush() == "z"


def test_private_key_is_replaced_as_soon_as_its_header_is_complete():
    stream = StreamMasker(PiiMasker())
    assert stream.feed("key: -----BEGIN RSA PRI") == "key: "
    assert stream.feed("VATE KEY-----\nMIIEow") == "[SECRET_1]"
    assert stream.feed("IBAAKCAQEA7yH2\n" * 50) == ""
    assert stream.feed("-----END RSA PRIVATE KEY----- done.") == " "
    assert stream.flush() == "done."
    assert stream.found["[SECRET_1]"].startswith("-----BEGIN RSA PRIVATE KEY-----\nMIIEow")
    assert stream.found["[SECRET_1]"].endswith("-----END RSA PRIVATE KEY-----")


def test_certificate_header_is_not_held_forever():
    stream = StreamMasker(PiiMasker())
    out = stream.feed("-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE----- ok ")
    assert out == "-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE----- ok "


def test_output_masker_shares_the_request_placeholders():
    masker = PiiMasker()
    placeholders = Placeholders()
    prompt = masker.mask("I am bob@example.com", placeholders)
    stream = StreamMasker(masker, placeholders)
    out = stream.feed("Hi [EMAIL_1] (bob@example.com), meet eve@example.com ") + stream.flush()
    assert prompt.text == "I am [EMAIL_1]"
    assert out == "Hi [EMAIL_1] ([EMAIL_1]), meet [EMAIL_2] "


def test_restorer_across_every_split():
    mapping = {"[EMAIL_1]": "bob@example.com", "[PHONE_12]": "13812345678"}
    text = "Dear [EMAIL_1], we will call [PHONE_12] [1] [EMAIL_3] [x] done ["
    expected = "Dear bob@example.com, we will call 13812345678 [1] [EMAIL_3] [x] done ["
    for cut1 in range(len(text)):
        for cut2 in range(cut1, len(text), 7):
            restorer = StreamRestorer(mapping)
            out = restorer.feed(text[:cut1]) + restorer.feed(text[cut1:cut2]) + restorer.feed(text[cut2:])
            assert out + restorer.flush() == expected


def test_restorer_holds_only_a_possible_placeholder():
    restorer = StreamRestorer({"[EMAIL_1]": "bob@example.com"})
    assert restorer.feed("see [") == "see "
    assert restorer.feed("E") == ""
    assert restorer.feed("MAIL_") == ""
    assert restorer.feed("1] and [1") == "bob@example.com and [1"
    assert restorer.feed("] [PHONE_1") == "] [PHONE_1"  # no PHONE in this request's mapping
    assert restorer.feed(" [EMAILX") == " [EMAILX"
    assert restorer.feed(" [EMAIL_") == " "
    assert restorer.flush() == "[EMAIL_"


def test_restorer_without_mapping_is_a_pass_through():
    restorer = StreamRestorer({})
    assert restorer.feed("a [EMAIL_") == "a [EMAIL_"
    assert restorer.flush() == ""


def test_mask_then_restore_round_trips_the_users_own_data():
    masker = PiiMasker()
    chat = masker.mask_messages([Message("user", "My card is 4111 1111 1111 1111")])
    out_mask = StreamMasker(masker, chat.placeholders)
    restorer = StreamRestorer(chat.found)
    answer = "Your card [CARD_1] is noted; ours is 5555 5555 5555 4444."
    emitted = [restorer.feed(out_mask.feed(p)) for p in pieces(answer, random.Random(7))]
    emitted.append(restorer.feed(out_mask.flush()) + restorer.flush())
    assert "".join(emitted) == "Your card 4111 1111 1111 1111 is noted; ours is [CARD_2]."


VALUES = ["bob.smith@example.com", "+1 (415) 555-2671", "0086 138 1234 5678", "11010519491231002X",
          "4111-1111-1111-1111", "192.168.10.20", "2001:0db8:85a3::8a2e:0370:7334", "fe80::1%eth0",
          "AKIAIOSFODNN7EXAMPLE", "536-22-1234", "sk-proj-abcdefghijklmnopqrstuvwxyz012345", PEM,
          "+44 20 7946 0958", "1.2.3.4"]
FILLER = ["the", "model", "answer", "v2.0.1", "12:30:45", "2024-01-15", "order", "#202401150001", "12", "items,",
          "3.5%", "请", "总结", "要点。", "(see", "4.2)", "and", "1 2 3", "at", "node-7"]


@pytest.mark.parametrize("seed", range(40))
def test_generated_answers_stream_like_the_whole(seed):
    rng = random.Random(seed)
    words = [rng.choice(FILLER) for _ in range(300)]
    for value in VALUES:
        words.insert(rng.randrange(len(words)), value)
    text = rng.choice([" ", "\n", " "]).join(words)
    masker = PiiMasker()
    out, _, _ = stream_mask(masker, pieces(text, rng))
    assert out == masker.mask(text).text
