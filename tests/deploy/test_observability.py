"""deploy/grafana/tandem.json and deploy/prometheus/alerts.yaml query only metrics that the
components export, in PromQL that a real parser (promql-parser) accepts, and the rules file
has the shape Prometheus loads. The exported names come from the components' own registries
rendered in the Prometheus text format, as their /metrics endpoints serve them."""

from __future__ import annotations

import json
import os
import re

import jsonschema
import promql_parser
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from engine.metrics import ROLES
from tests.deploy.chart import ROOT
from tests.deploy.test_promtool import component_metrics

DASHBOARD = os.path.join(ROOT, "deploy", "grafana", "tandem.json")
ALERTS = os.path.join(ROOT, "deploy", "prometheus", "alerts.yaml")
# The series each metric type puts in the text format.
SUFFIXES = {"counter": ("_total", "_created"), "gauge": ("",),
            "histogram": ("_bucket", "_sum", "_count", "_created"),
            "summary": ("", "_sum", "_count", "_created"), "info": ("_info",)}
# What Grafana substitutes before a query reaches Prometheus.
GRAFANA_VARS = re.compile(r"\$(__rate_interval|__interval|__range)\b|\$\{?(\w+)\}?")
NAME = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")
TEMPLATE = re.compile(r"{{\s*(.*?)\s*}}")
TEMPLATE_OK = re.compile(
    r"^(\$labels\.(?P<label>\w+)|\$value(\s*\|\s*(humanize|humanizePercentage|"
    r"humanizeDuration))?)$")
RULES_SCHEMA = {  # Prometheus' rule file format (docs: "Recording rules", "Alerting rules")
    "type": "object", "required": ["groups"], "additionalProperties": False,
    "properties": {"groups": {"type": "array", "minItems": 1, "items": {
        "type": "object", "required": ["name", "rules"], "additionalProperties": False,
        "properties": {
            "name": {"type": "string", "minLength": 1},
            "interval": {"type": "string"}, "limit": {"type": "integer"},
            "rules": {"type": "array", "minItems": 1, "items": {
                "type": "object", "required": ["alert", "expr"], "additionalProperties": False,
                "properties": {
                    "alert": {"type": "string", "pattern": NAME.pattern},
                    "expr": {"type": "string", "minLength": 1},
                    "for": {"type": "string"}, "keep_firing_for": {"type": "string"},
                    "labels": {"type": "object", "additionalProperties": {"type": "string"}},
                    "annotations": {"type": "object",
                                    "additionalProperties": {"type": "string"}}}}}}}}},
}


@pytest.fixture(scope="module")
def exported() -> set[str]:
    """Every series name a component's /metrics can carry: its registry, as each component
    builds it (router, prefill and decode nodes), in the text format."""
    names = set()
    for role in ("router", "prefill", "decode"):
        text = component_metrics(role).exposition().decode()
        for family in text_string_to_metric_families(text):
            names |= {family.name + s for s in SUFFIXES.get(family.type, ("",))}
    assert "tandem_requests_total" in names and "tandem_ttft_seconds_bucket" in names
    assert {"tandem_ready_seconds", "tandem_jit_compiles_after_ready_total",
            "tandem_gc_pauses_total", "tandem_gc_pause_seconds_total"} <= names
    return names


def selectors(expr: str) -> list[promql_parser.VectorSelector]:
    found = []
    promql_parser.walk(promql_parser.parse(expr), lambda n: found.append(n) if isinstance(
        n, promql_parser.VectorSelector) else None)
    return found


def grouping_labels(expr: str) -> set[str]:
    """Labels an expression keeps: those of its `by (...)` clauses."""
    labels = set()

    def visit(node):
        if isinstance(node, promql_parser.AggregateExpr) and node.modifier is not None:
            labels.update(node.modifier.labels)

    promql_parser.walk(promql_parser.parse(expr), visit)
    return labels


def check_query(expr: str, exported: set[str]) -> list[str]:
    """What is wrong with one query: metrics no component exports, roles that do not exist."""
    problems = []
    for sel in selectors(expr):
        if sel.name not in exported:
            problems.append(f"{sel.name} is not exported")
        for m in sel.matchers.matchers:
            if m.name == "role" and not any(
                    re.fullmatch(m.value, r) for r in ROLES):
                problems.append(f"role {m.value!r} matches no role of {ROLES}")
    if not selectors(expr):
        problems.append("queries no metric")
    return problems


def dashboard_queries() -> list[tuple[str, str]]:
    with open(DASHBOARD) as f:
        dash = json.load(f)
    queries = []
    for panel in dash["panels"]:
        for target in panel.get("targets", []):
            queries.append((panel["title"], target["expr"]))
    return queries


def grafana_to_promql(expr: str) -> str:
    return GRAFANA_VARS.sub(lambda m: "5m" if m.group(1) else ".*", expr)


def test_the_dashboard_queries_exported_metrics(exported):
    queries = dashboard_queries()
    assert len(queries) >= 20
    problems = {}
    for title, expr in queries:
        try:
            found = check_query(grafana_to_promql(expr), exported)
        except ValueError as e:
            found = [f"does not parse: {e}"]
        if found:
            problems[f"{title}: {expr}"] = found
    assert not problems, problems


def test_the_dashboard_shows_what_operators_ask_for():
    """TTFT / ITL / TPOT percentiles, tokens/s, acceptance by position, KV use, transfer GB/s
    and failures, queue depth, errors by code, time to ready and compiles after it; panels laid
    out without clashes."""
    with open(DASHBOARD) as f:
        dash = json.load(f)
    exprs = " ".join(expr for _, expr in dashboard_queries())
    for needle in ("histogram_quantile(0.99, sum by (le) (rate(tandem_ttft_seconds_bucket",
                   "tandem_itl_seconds_bucket", "tandem_tpot_seconds_bucket",
                   "rate(tandem_generated_tokens_total",
                   "sum by (position) (rate(tandem_spec_accepted_tokens_total",
                   "tandem_kv_blocks_used", "rate(tandem_kv_transfer_bytes_total",
                   "tandem_kv_transfer_failures_total", "tandem_queue_depth",
                   "sum by (code) (rate(tandem_request_errors_total",
                   "tandem_ready_seconds", "increase(tandem_jit_compiles_after_ready_total"):
        assert needle in exprs, needle
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    cells = set()
    for p in dash["panels"]:
        g = p["gridPos"]
        assert g["x"] + g["w"] <= 24, p["title"]
        cell = {(x, y) for x in range(g["x"], g["x"] + g["w"])
                for y in range(g["y"], g["y"] + g["h"])}
        assert not cells & cell, f"{p['title']} overlaps another panel"
        cells |= cell
        if p["type"] != "row":
            assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
    variables = {v["name"] for v in dash["templating"]["list"]}
    used = {m.group(2) for _, e in dashboard_queries() for m in GRAFANA_VARS.finditer(e)}
    assert used - {None} <= variables


def load_rules() -> list[dict]:
    with open(ALERTS) as f:
        doc = yaml.safe_load(f)
    jsonschema.validate(doc, RULES_SCHEMA)
    names = [g["name"] for g in doc["groups"]]
    assert len(names) == len(set(names)), "group names must be unique"
    return [rule for g in doc["groups"] for rule in g["rules"]]


def test_the_alert_rules_load_and_query_exported_metrics(exported):
    """What `promtool check rules` checks (no package on PyPI or npm ships promtool): the
    file's shape, unique group names, PromQL that parses, durations, label names and
    annotation templates; and beyond it, that every metric is one the components export."""
    problems = {}
    for rule in load_rules():
        found = check_query(rule["expr"], exported)
        for key in ("for", "keep_firing_for"):
            if key in rule:
                promql_parser.parse_duration(rule[key])  # raises on a bad duration
        found += [f"bad label name {k}" for k in rule.get("labels", {}) if not NAME.match(k)]
        kept = grouping_labels(rule["expr"])
        for text in rule.get("annotations", {}).values():
            for tpl in TEMPLATE.findall(text):
                m = TEMPLATE_OK.match(tpl)
                if m is None:
                    found.append(f"template {{{{ {tpl} }}}} is not one this file allows")
                elif m.group("label") and m.group("label") not in kept:
                    found.append(f"$labels.{m.group('label')} is aggregated away")
        if found:
            problems[rule["alert"]] = found
    assert not problems, problems


def test_the_alerts_cover_the_failure_modes():
    rules = {r["alert"]: r for r in load_rules()}
    wanted = {"TandemAcceptanceCollapse": "tandem_spec_accepted_tokens_total",
              "TandemITLSLOBreached": "tandem_itl_seconds_bucket",
              "TandemKVTransferFailures": "tandem_kv_transfer_failures_total",
              "TandemQueueGrowing": "tandem_queue_depth",
              "TandemCompilesAfterReady": "tandem_jit_compiles_after_ready_total"}
    for alert, metric in wanted.items():
        assert metric in {s.name for s in selectors(rules[alert]["expr"])}, alert
    assert all(r["labels"]["severity"] in ("warning", "critical") for r in rules.values())
    assert all({"summary", "description"} <= set(r["annotations"]) for r in rules.values())


def test_the_checks_catch_mistakes(exported):
    """Negative controls: an unknown metric, a misspelt role, a query that does not parse,
    an annotation naming a label the aggregation dropped."""
    assert check_query('rate(tandem_no_such_total[5m])', exported) == [
        "tandem_no_such_total is not exported"]
    assert "matches no role" in check_query('tandem_queue_depth{role="decoder"}', exported)[0]
    with pytest.raises(ValueError):
        check_query("sum(rate(tandem_requests_total[5m])", exported)
    assert "instance" not in grouping_labels("sum by (job) (tandem_queue_depth)")


def test_router_series_are_read_in_colocated_serving_too():
    """`tandem serve --colocated` labels its one registry `colocated` (engine and router in one
    process): a query for the router's series admits that role too."""
    text = open(DASHBOARD).read().replace('\\"', '"') + open(ALERTS).read()
    assert 'role="router"' not in text
    assert 'role=~"router|colocated"' in text
