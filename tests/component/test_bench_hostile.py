"""`python -m bench.hostile` runs against its own mesh and prints its summary (two small classes:
this checks the bench, not the figures); its default case set is what issue 26 asks (at least
1,000 cases: each guard rule and each bounded schema keyword, up to the body limit)."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_hostile_bench_prints_its_summary():
    done = subprocess.run([sys.executable, "-m", "bench.hostile", "--json", "--max-bytes", "20000", "--baseline-s", "1",
                           "--only", "pii_digits", "--only", "long_headers"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    assert report["five_xx"] == 0 and report["failed_victims"] == 0
    assert set(report["classes"]) == {"pii_digits", "long_headers"}
    digits = report["classes"]["pii_digits"]
    assert digits["cases"] == sum(digits["statuses"].values()) == 29  # 7 sizes x 4 variants, and the largest
    assert digits["worst_s"] > 0 and digits["peak_rss_mib"] > 0 and "stalls_over_50ms" in digits["loop"]
    assert report["baseline"]["victim_requests"] > 0 and report["attack"]["victim_p99_ratio"] > 0


def test_the_default_case_set_covers_every_rule_and_keyword_up_to_the_body_limit():
    from bench.hostile import by_class
    from bench.hostile_cases import PII_UNITS, encode
    from llmesh.gateway.domain.guards.injection import RULES
    from llmesh.gateway.fronts.http import MAX_BODY

    counts: dict[str, int] = {}
    largest = 0
    for cls, items in by_class(MAX_BODY, set()):
        for case in items:
            counts[cls] = counts.get(cls, 0) + 1
            largest = max(largest, len(encode(case.body)))
    assert sum(counts.values()) >= 1000, sum(counts.values())
    assert set(PII_UNITS) | {f"injection_{rule.name}" for rule in RULES} <= set(counts)
    keywords = {"minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties", "pattern repeat",
                "enum", "properties", "anyOf", "oneOf", "allOf", "prefixItems", "pattern groups", "$ref count",
                "depth", "bytes"}
    assert {f"schema_schema.{k}" for k in keywords} <= set(counts)
    assert MAX_BODY - 8192 < largest <= MAX_BODY  # the largest body that fits the limit
