"""Which metric names a PromQL expression (or a Grafana query) reads, without a PromQL parser.

The dashboard and the alert rules in deploy/ may query only what the model exports
(``loraplex.engine.metrics.EXPORTED_METRICS``) plus an explicit allow-list of Triton's, DCGM's and
Prometheus's own names. ``metric_names`` returns every metric name an expression references;
``label_matchers`` the ``label op value`` matchers attached to each; ``check_expression`` puts both
against the contract. What it understands:

* string literals ("...", '...', `...`) are never names, and Grafana variables (``$tenant``,
  ``${datasource}``, ``$__rate_interval``) are removed first;
* ``{...}`` selectors hold label names, except ``__name__="x"`` which names a metric;
* ``[5m]``, ``[10m:1m]`` ranges and subqueries, ``offset 5m``, ``@ 123``, numbers and durations;
* ``by (...)``, ``without (...)``, ``on (...)``, ``ignoring (...)``, ``group_left (...)`` and
  ``group_right (...)`` hold label names;
* an identifier followed by ``(`` is a function or an aggregation and must be a known one (a typo
  such as ``histogram_quantil(`` is an error, not a metric), keywords (``and``, ``or``, ``unless``,
  ``bool``, ...) are skipped, and every other identifier is a metric name;
* Grafana's ``label_values(metric{...}, label)`` and ``label_values(label)``.
"""

from __future__ import annotations

import re

HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")

# PromQL functions (Prometheus 3.x, including the experimental ones) and aggregation operators.
FUNCTIONS = frozenset("""
abs absent absent_over_time acos acosh asin asinh atan atanh avg_over_time ceil changes clamp clamp_max
clamp_min cos cosh count_over_time days_in_month day_of_month day_of_week day_of_year deg delta deriv
double_exponential_smoothing exp floor histogram_avg histogram_count histogram_fraction histogram_quantile
histogram_stddev histogram_stdvar histogram_sum holt_winters hour idelta increase info irate label_join
label_replace last_over_time ln log10 log2 mad_over_time max_over_time min_over_time minute month pi
predict_linear present_over_time quantile_over_time rad rate resets round scalar sgn sin sinh sort
sort_by_label sort_by_label_desc sort_desc sqrt stddev_over_time stdvar_over_time sum_over_time tan tanh
time timestamp vector year start end
""".split())
AGGREGATIONS = frozenset("""
sum min max avg group stddev stdvar count count_values bottomk topk quantile limitk limit_ratio
""".split())
KEYWORDS = frozenset("and or unless bool offset by without on ignoring group_left group_right atan2 inf nan".split())
LABEL_LIST_KEYWORDS = ("by", "without", "on", "ignoring", "group_left", "group_right")

_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_GRAFANA_VAR = re.compile(r"\$\{[^}]*\}|\$\w+|\[\[\w+\]\]")
_SELECTOR = re.compile(r"\{([^{}]*)\}")
_RANGE = re.compile(r"\[[^\[\]]*\]")
_LABEL_LIST = re.compile(r"\b(?:%s)\s*\(([^()]*)\)" % "|".join(LABEL_LIST_KEYWORDS))
_OFFSET = re.compile(r"\boffset\s+-?\w+|@\s*[\w.+-]+(?:\(\))?")
_NUMBER = re.compile(r"(?<![\w:])(?:0x[0-9a-fA-F]+|\d+(?:\.\d*)?(?:[eE][+-]?\d+)?|\.\d+(?:[eE][+-]?\d+)?)"
                     r"(?:ms|[smhdwy])*(?![\w:])")
_IDENT = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*")
_MATCHER = re.compile(r'\s*([A-Za-z_][A-Za-z0-9_]*)\s*(=~|!~|!=|=)\s*("(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`)\s*,?')
_LABEL_VALUES = re.compile(r"^\s*label_values\(\s*(.*?)\s*(?:,\s*([A-Za-z_][A-Za-z0-9_]*)\s*)?\)\s*$", re.S)


class PromQLError(ValueError):
    """An expression this checker cannot read, or one that breaks the metrics contract."""


def _balanced(expr: str) -> None:
    pairs, stack = {")": "(", "]": "[", "}": "{"}, []
    for ch in _STRING.sub('""', expr):
        if ch in "([{":
            stack.append(ch)
        elif ch in ")]}":
            if not stack or stack.pop() != pairs[ch]:
                raise PromQLError(f"unbalanced {ch!r} in {expr!r}")
    if stack:
        raise PromQLError(f"unclosed {stack[-1]!r} in {expr!r}")


def _unquote(literal: str) -> str:
    return literal[1:-1]


def grafana_query(query: str) -> str:
    """The PromQL inside a Grafana variable query (``label_values(expr, label)``), or the query itself."""
    m = _LABEL_VALUES.match(query)
    if m is None:
        return query
    if m.group(2) is None:  # label_values(label): no metric
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", m.group(1)):
            raise PromQLError(f"cannot read {query!r}")
        return ""
    return m.group(1)


def _parse_selector(body: str, expr: str) -> list[tuple[str, str, str]]:
    matchers, pos = [], 0
    while pos < len(body):
        if not body[pos:].strip():
            break
        m = _MATCHER.match(body, pos)
        if m is None:
            raise PromQLError(f"cannot read label matchers {{{body}}} in {expr!r}")
        matchers.append((m.group(1), m.group(2), _unquote(m.group(3))))
        pos = m.end()
    return matchers


def _scan(expr: str) -> list[tuple[str, list[tuple[str, str, str]]]]:
    """(metric name, its matchers) for every selector of ``expr``, in order."""
    _balanced(expr)
    text = _GRAFANA_VAR.sub("", expr)
    found: list[tuple[str, list]] = []
    selectors: dict[str, list] = {}

    def selector(m: re.Match) -> str:
        key = f" __sel{len(selectors)}__ "
        selectors[key.strip()] = _parse_selector(m.group(1), expr)
        return key

    # Selectors first (their values are strings that may hold anything), then strings elsewhere.
    text = _SELECTOR.sub(selector, text)
    text = _STRING.sub(" ", text)
    while True:  # subqueries nest ranges: [10m:1m] inside nothing else, but be thorough
        stripped = _RANGE.sub(" ", text)
        if stripped == text:
            break
        text = stripped
    while True:
        stripped = _LABEL_LIST.sub(" ", text)
        if stripped == text:
            break
        text = stripped
    text = re.sub(r"\b(group_left|group_right)\b", " ", text)
    text = _OFFSET.sub(" ", text)
    text = _NUMBER.sub(" ", text)
    tokens = list(re.finditer(r"__sel\d+__|[A-Za-z_:][A-Za-z0-9_:]*|\S", text))
    for i, tok in enumerate(tokens):
        word = tok.group(0)
        if re.fullmatch(r"__sel\d+__", word):
            prev = tokens[i - 1].group(0) if i else ""
            if prev and _IDENT.fullmatch(prev) and not re.fullmatch(r"__sel\d+__", prev) \
                    and prev not in FUNCTIONS | AGGREGATIONS | KEYWORDS:
                found[-1][1].extend(selectors[word])  # metric{...}: matchers of the name just seen
                continue
            matchers = selectors[word]
            names = [v for label, op, v in matchers if label == "__name__" and op == "="]
            if not names:
                raise PromQLError(f"a selector without a metric name in {expr!r}")
            found.append((names[0], [m for m in matchers if m[0] != "__name__"]))
            continue
        if not _IDENT.fullmatch(word):
            continue
        nxt = tokens[i + 1].group(0) if i + 1 < len(tokens) else ""
        if word in KEYWORDS:
            continue
        if nxt == "(":
            if word not in FUNCTIONS | AGGREGATIONS:
                raise PromQLError(f"unknown PromQL function {word!r} in {expr!r}")
            continue
        if word in FUNCTIONS | AGGREGATIONS and word not in ("start", "end"):
            # an aggregation written `sum by (x) (...)`: the label list is gone, `(` follows later
            continue
        found.append((word, []))
    return found


def metric_names(expr: str) -> set[str]:
    """Every metric name ``expr`` references (as written: histogram series keep their suffix)."""
    return {name for name, _ in _scan(grafana_query(expr))}


def label_matchers(expr: str) -> list[tuple[str, str, str, str]]:
    """(metric, label, operator, value) of every label matcher in ``expr``."""
    return [(name, label, op, value) for name, matchers in _scan(grafana_query(expr)) for label, op, value in matchers]


def base_name(name: str, exported: frozenset[str] | set[str]) -> str:
    """The family a series name belongs to: ``x_bucket`` / ``x_sum`` / ``x_count`` of histogram ``x``."""
    if name in exported:
        return name
    for suffix in HISTOGRAM_SUFFIXES:
        base = name[: -len(suffix)]
        if name.endswith(suffix) and base in exported and not base.endswith("_total"):
            return base
    return name


def check_expression(expr: str, exported, allowed=frozenset(), label_values: dict | None = None) -> set[str]:
    """The families ``expr`` reads; PromQLError if one is neither exported nor allowed, or a matcher
    names a label value outside ``label_values[(family, label)]``."""
    families = set()
    for name in metric_names(expr):
        family = base_name(name, exported)
        if family not in exported and family not in allowed:
            raise PromQLError(f"{name!r} is not a metric the model exports (nor allow-listed), in {expr!r}")
        families.add(family)
    for name, label, op, value in label_matchers(expr):
        known = (label_values or {}).get((base_name(name, exported), label))
        if known is None or op not in ("=", "=~"):
            continue
        if not re.fullmatch(r"[A-Za-z0-9_]+(\|[A-Za-z0-9_]+)*", value):
            continue  # a real regex (.*, a Grafana variable's value): nothing to enumerate
        unknown = set(value.split("|")) - set(known)
        if unknown:
            raise PromQLError(f"{name}{{{label}{op}{value!r}}}: {sorted(unknown)} not among {sorted(known)}")
    return families
