"""The prompt-injection screen's rules: a name, a weight in (0, 1), the start terms that say
whether the rule is worth trying on a text, and a pattern in RE2's syntax.

Patterns run on RE2 (``google-re2``), which matches in time linear in the text whatever the
pattern: no backtracking, so no input can make a rule slow (the rules once ran on Python's
``re``, where overlapping ``(?:(?:all|your)\\s+)*`` groups took 61 s over "ignore " and 80 KB of
"your " that a stray word kept from ending in "instructions").
The repetitions are bounded all the same (at most ``_FILL`` filler words), so a rule means
what it says. RE2 differs from ``re`` in two ways the patterns make up for:

- ``\\s`` is ASCII only in RE2; ``_S`` is Python's whitespace (NBSP, ideographic space, ...).
- ``\\b`` is ASCII only in RE2. A rule's English alternatives start with ``\\b`` (a start word is
  a whole word: "reset" does not start "set aside"); one that must end on a whole word ends
  with ``_END`` (no letter, digit or "_" of any script after it), as ``re``'s ``\\b`` did.

Every pattern is case-insensitive (compiled with ``(?i)``)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Rule:
    """``pattern`` (RE2 syntax, case-insensitive) is searched only when one of ``starts`` is in
    the text (a whole word for ASCII words) and every group of ``needs`` has a member there.
    ``line_start``: only spaces, tabs or '#' may come before the match on its line."""
    name: str
    weight: float
    starts: tuple[str, ...]
    pattern: str
    needs: tuple[tuple[str, ...], ...] = ()
    line_start: bool = False


_S = r"[\t-\r\x{1c}-\x{20}\x{85}\p{Z}]"  # Python's \s: whitespace of any script
_NS = r"[^\t-\r\x{1c}-\x{20}\x{85}\p{Z}]"
_END = r"(?:$|[^\pL\pN_])"  # re's \b after a word character
_GAP = r"[^\pL\pN_.\n]"  # a character between two words that is no full stop or line break
_FILL = 6  # filler words ("all of the") a phrase may carry: bounded, so a match means a phrase

_IGNORE = ("ignore", "disregard", "forget", "override", "bypass", "skip", "throw", "set")
_EN_IGNORE_VERB = rf"\b(?:ignore|disregard|forget|override|bypass|skip|throw{_S}+away|set{_S}+aside)"
_EN_PRIOR = r"(?:previous|prior|above|earlier|preceding|foregoing|initial|original|system|developer|your|all|any)"
_EN_ORDERS = r"(?:instructions?|prompts?|rules|guidelines|directions|directives|guardrails|constraints|programming)"
_EN_ORDER_WORDS = ("instruction", "instructions", "prompt", "prompts", "rules", "guidelines", "directions",
                   "directives", "guardrails", "constraints", "programming")
_ZH_ORDERS = r"(?:指令|指示|规则|提示词?|设定|要求|命令|限制|约束|规定)"
_REVEAL = ("reveal", "leak", "dump", "print", "output", "repeat", "show", "tell", "give", "share", "display",
           "write", "spell")
_ZH_REVEAL = ("输出", "显示", "告诉我", "打印", "重复", "泄露", "透露", "给我看", "展示", "说出", "复述")
_GIVEN = rf"(?:above|before|you{_S}+(?:were|have{_S}+been){_S}+given)"

RULES: tuple[Rule, ...] = (
    Rule("ignore_instructions", 0.8, _IGNORE,
         rf"{_EN_IGNORE_VERB}{_S}+(?:(?:all|any|of|the|these|those|my|your){_S}+){{0,{_FILL}}}{_EN_PRIOR}{_S}+"
         rf"(?:(?:the|of|your|my|previous|prior|system|safety){_S}+){{0,{_FILL}}}{_EN_ORDERS}{_END}"
         rf"|{_EN_IGNORE_VERB}{_S}+(?:all{_S}+|the{_S}+)?{_EN_ORDERS}{_S}+{_GIVEN}"
         rf"|\bforget{_S}+(?:everything|all){_S}+(?:above|before|you{_S}+(?:were|have{_S}+been){_S}+told)",
         ((*_EN_ORDER_WORDS, "everything", "all"),)),
    Rule("ignore_instructions_zh", 0.8, ("忽略", "无视", "忘记", "忘掉", "不要理会", "不要管", "抛开", "跳过", "绕过"),
         r"(?:忽略|无视|忘记|忘掉|不要理会|不要管|抛开|跳过|绕过)掉?(?:你)?(?:之前|以前|先前|此前|上面|以上|上述|前面|"
         rf"所有|全部|一切|原来|原有|系统)的?(?:所有|全部|一切)?的?{_ZH_ORDERS}"),
    Rule("reveal_system_prompt", 0.7, _REVEAL,
         rf"\b(?:reveal|leak|dump|print|output|repeat|show|tell|give|share|display|write{_S}+out|spell{_S}+out){_S}+"
         rf"(?:me{_S}+|us{_S}+)?(?:back{_S}+)?your{_S}+(?:full{_S}+|entire{_S}+|exact{_S}+|complete{_S}+|whole{_S}+)?"
         rf"(?:system|initial|original|hidden|secret|developer|internal|pre-?){_S}*(?:prompt|instructions?|message)"
         rf"|\b(?:reveal|leak|dump){_S}+(?:the{_S}+)?(?:system|initial|hidden|secret|developer){_S}+"
         rf"(?:prompt|instructions?)"
         rf"|\brepeat{_S}+(?:all{_S}+)?(?:the{_S}+)?(?:words|text|everything|instructions){_S}+"
         rf"(?:above|before{_S}+this){_S}+(?:starting|beginning){_S}+with",
         (("system", "initial", "original", "hidden", "secret", "developer", "internal", "prompt", "pre",
           "preprompt", "starting", "beginning"),)),
    Rule("repeat_above", 0.4, ("repeat", "print", "output"),
         rf"\b(?:repeat|print|output){_S}+(?:all{_S}+)?(?:the{_S}+)?(?:words|text|everything|instructions){_S}+"
         rf"(?:above|before{_S}+this)", (("above", "before"),)),
    Rule("ask_system_prompt", 0.4, ("what",),
         rf"\bwhat{_S}+(?:is|are|were){_S}+your{_S}+(?:system|initial|original|hidden|secret){_S}+"
         rf"(?:prompt|instructions?)",
         (("your",), ("prompt", "instruction", "instructions"))),
    Rule("reveal_system_prompt_zh", 0.7, _ZH_REVEAL,
         r"(?:输出|显示|告诉我|打印|重复|泄露|透露|给我看|展示|说出|复述)(?:一下)?(?:你的|你)(?:完整的?|全部的?|原始的?)?"
         r"(?:系统提示词?|初始指令|系统指令|隐藏指令|原始指令|系统设定|提示词|prompt)"
         r"|(?:泄露|透露)(?:一下)?(?:系统提示词?|系统指令)"),
    Rule("jailbreak_persona", 0.8, ("do", "you", "act", "pretend", "roleplay", "role", "become"),
         rf"\bdo{_S}+anything{_S}+now{_END}"
         rf"|\b(?:you{_S}+are|you're|act{_S}+as|pretend{_S}+(?:to{_S}+be|you{_S}+are)|role-?play{_S}+as|become)"
         rf"{_S}+(?:now{_S}+)?"
         rf"(?:(?-i:DAN){_END}|an?{_S}+(?:unrestricted|unfiltered|uncensored|jailbroken|evil|unaligned|amoral){_S}+"
         r"(?:ai|assistant|model|chatbot|version|llm))",
         (("anything", "dan", "unrestricted", "unfiltered", "uncensored", "jailbroken", "evil", "unaligned",
           "amoral"),)),
    Rule("special_mode", 0.4, ("enable", "activate", "enter", "switch", "turn", "developer", "god", "dan", "sudo",
                               "jailbreak"),
         rf"\b(?:enable|activate|enter|switch{_S}+(?:on|to)|turn{_S}+on){_S}+(?:the{_S}+)?"
         rf"(?:developer|god|dan|sudo|jailbreak){_S}+mode"
         rf"|\b(?:developer|god|dan|sudo|jailbreak){_S}+mode{_S}+(?:is{_S}+)?(?:enabled|activated|on){_END}",
         (("mode",),)),
    Rule("jailbreak_word", 0.4, ("jailbreak", "jailbroken", "jailbreaking", "jailbreaks"), r"\bjailbr(?:eak|oken)"),
    Rule("no_restrictions", 0.5, ("without", "free", "not", "no", "ignore"),
         rf"\b(?:without|free{_S}+(?:of|from)|not{_S}+bound{_S}+by|no{_S}+longer{_S}+(?:bound|restricted){_S}+by|no"
         rf"|ignore){_S}+(?:any{_S}+)?(?:restrictions|filters|limitations|censorship|ethical{_S}+"
         rf"(?:guidelines|constraints)|content{_S}+polic(?:y|ies)|moral(?:s|ity)?|safety{_S}+"
         rf"(?:guidelines|rules|filters)){_END}",
         (("restrictions", "filters", "limitations", "censorship", "ethical", "content", "moral", "morals",
           "morality", "safety"),)),
    Rule("no_restrictions_zh", 0.5, ("不受", "没有", "摆脱", "无视", "突破", "解除", "不用遵守", "不必遵守"),
         r"(?:不受|没有|摆脱|无视|突破|解除|不用遵守|不必遵守)(?:任何)?(?:的)?(?:限制|约束|审查|道德|规则|过滤|束缚|安全准则)"),
    Rule("persona_switch_zh", 0.3, ("你现在是", "从现在", "扮演一个", "进入", "越狱"),
         rf"你现在是|从现在(?:开始|起)[，,]?{_S}*你|扮演一个|进入(?:开发者|上帝|越狱)模式|越狱"),
    Rule("role_tag_system", 0.9, ("<|", "<<sys>>"),
         rf"<\|im_start\|>{_S}*system|<\|start_header_id\|>{_S}*system|<<sys>>|<\|system\|>", (("|", "<<"),)),
    Rule("role_tag", 0.5, ("<|", "[inst]", "[/inst]"),
         r"<\|(?:im_start|im_end|endoftext|eot_id|start_header_id|end_header_id|begin_of_text|user|assistant)\|>"
         r"|\[/?inst\]", (("|", "["),)),
    Rule("fake_role_line", 0.35, ("system", "developer"),
         rf"(?m)^[ \t#]*(?:system|developer)(?:[ \t]+(?:prompt|message|instructions?))?[ \t]*:[ \t]*{_NS}",
         ((":",),), line_start=True),
    Rule("new_instructions", 0.4, ("new", "updated", "revised", "real", "actual", "true", "新"),
         rf"\b(?:new|updated|revised|real|actual|true){_S}+(?:system{_S}+)?instructions?{_S}*:"
         r"|新的?(?:系统)?指令[:：]",
         (("instruction", "instructions", "指令"),)),
    Rule("from_now_on", 0.25, ("from", "从现在"), rf"\bfrom{_S}+now{_S}+on,?{_S}+(?:you|your){_END}|从现在(?:开始|起)",
         (("now", "从现在"),)),
    Rule("decode_and_follow", 0.4, ("decode", "base64", "rot13"),
         rf"\b(?:decode|base64|rot13)(?:{_GAP}|{_GAP}[^.\n]{{0,78}}{_GAP})"
         rf"(?:follow|execute|obey|do{_S}+(?:what|as){_S}+it{_S}+says){_END}",
         (("follow", "execute", "obey", "says"),)),
)
