"""The references in `docs/` checked against the code, so they cannot drift from it.

What the EPP exposes is read from the code itself: the metric registry of a constructed (not
started) `EppServer`, the `msgspec` structs of the config and of every plugin's parameters,
`default_registry()`, and the `epp serve` argparse parser. It is compared with the tables of
`docs/metrics.md` and `docs/configuration.md`; every disagreement is one line of `problems()`.
`python -m epp.docs_reference` prints them (with the row to add for anything missing) and exits
1 when there are any; `tests/unit/test_docs.py` runs the same check.

The tables are found by their header rows:

- `| metric | type | labels | meaning |`: the name as exposed (counters with `_total`), its type,
  its label names as `code`, comma-separated (`—` for none);
- `| key | default | meaning |` under a heading naming the config section: `### Top-level keys`
  or `### \\`kvEvents\\``, `### \\`costModel.profiles[]\\``, ... (`[]`: each list item,
  `.<name>`: each value of a mapping);
- `| type | kind | ... |`: every plugin type and its kind;
- `| plugin | parameter | default | meaning |`: every parameter of every plugin;
- `| flag | ... |`: flags of `epp serve` (each must exist; every flag must appear in some doc).

A default cell starts with the default as YAML writes it, in `code` (`5557`, `2s`, `[""]`),
or with `unset` (the key is optional and has no value) or `required`.
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import re
import sys
import types
from collections.abc import Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Union, get_args, get_origin

import msgspec
import yaml
from prometheus_client import CollectorRegistry
from prometheus_client.metrics import MetricWrapperBase

from epp.config import ConfigDoc
from epp.costmodel.profile import ProfileSpec
from epp.costmodel.service import CalibrationSpec
from epp.scheduling.registry import PluginRegistry

ROOT = pathlib.Path(__file__).resolve().parents[1]
METRICS_DOC = "docs/metrics.md"
CONFIG_DOC = "docs/configuration.md"
TOP_LEVEL = "Top-level keys"
UNSET = "unset"
REQUIRED = "required"
# `costModel` is a free mapping in ConfigDoc; `epp.costmodel.service.parse_cost_model` takes these keys.
COST_MODEL_KEYS: dict[str, Any] = {"profiles": list[ProfileSpec], "calibration": CalibrationSpec}

_CODE = re.compile(r"`([^`]*)`")
_CELL_SPLIT = re.compile(r"(?<!\\)\|")
_SEPARATOR = re.compile(r"^:?-+:?$")
_FLAG = re.compile(r"--[a-z0-9][a-z0-9-]*")
_NONE_CELLS = ("", "—", "-", "none")


# -- what the code exposes ----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class MetricInfo:
    name: str  # as exposed: counters end in `_total`
    type: str
    labels: frozenset[str]


@dataclass(frozen=True, slots=True)
class KeyInfo:
    name: str  # as written in YAML
    default: str  # as the docs write it: YAML text, `unset` or `required`


@dataclass(frozen=True, slots=True)
class PluginInfo:
    type_name: str
    kind: str
    params: Mapping[str, KeyInfo]


def _exposed_name(name: str, typ: str) -> str:
    return f"{name}_total" if typ == "counter" else name


def registry_metrics(registry: CollectorRegistry) -> dict[str, MetricInfo]:
    """Every metric family of `registry` with its type and label names, whether it has samples or not.

    prometheus_client has no public way to list a registry's collectors or a metric's label
    names; the two private attributes are read here only, and fail loudly if they change.
    """
    out: dict[str, MetricInfo] = {}
    for collector in list(registry._collector_to_names):
        if isinstance(collector, CollectorRegistry):  # a registry registered in another (`EppMetrics`)
            out.update(registry_metrics(collector))
            continue
        if isinstance(collector, MetricWrapperBase):
            labels = frozenset(collector._labelnames)
            families = collector.describe()
        else:
            families = list(collector.collect())
        for fam in families:
            if not isinstance(collector, MetricWrapperBase):
                names = getattr(fam, "_labelnames", None)
                if names is None:
                    if not fam.samples:
                        raise ValueError(f"cannot tell the label names of {fam.name!r}: no samples")
                    names = {k for s in fam.samples for k in s.labels if k not in ("le", "quantile")}
                labels = frozenset(names)
            name = _exposed_name(fam.name, fam.type)
            out[name] = MetricInfo(name, fam.type, labels)
    return out


def exposed_metrics() -> dict[str, MetricInfo]:
    """Every metric the EPP's `/metrics` serves: the registry of a server built with the default config."""
    from epp.config import default_config
    from epp.server.app import EppServer, ServerSettings

    server = EppServer(ServerSettings(secure_serving=False, refresh_metrics_interval=0), default_config())
    return registry_metrics(server.metrics.registry)


def yaml_text(value: Any) -> str:
    """A default as YAML writes it: `true`, `5557`, `0.05`, `2s`, `"*"`, `[""]`."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, str):
        try:
            plain = value != "" and yaml.safe_load(value) == value
        except yaml.YAMLError:
            plain = False
        return value if plain else json.dumps(value)
    return json.dumps(value)


def _default(field: msgspec.structs.FieldInfo) -> str:
    if field.default is not msgspec.NODEFAULT:
        value = field.default
    elif field.default_factory is not msgspec.NODEFAULT:
        value = field.default_factory()
    else:
        return REQUIRED
    return UNSET if value is None else yaml_text(value)


def struct_keys(struct: type[msgspec.Struct]) -> dict[str, KeyInfo]:
    return {f.encode_name: KeyInfo(f.encode_name, _default(f)) for f in msgspec.structs.fields(struct)}


def _nested(tp: Any, suffix: str = "") -> Iterator[tuple[str, type[msgspec.Struct]]]:
    """(path suffix, struct) for every struct a field of type `tp` holds: `[]` per list item,
    `.<name>` per mapping value."""
    origin = get_origin(tp)
    if isinstance(tp, type) and issubclass(tp, msgspec.Struct):
        yield suffix, tp
    elif origin in (Union, types.UnionType):
        for arg in get_args(tp):
            yield from _nested(arg, suffix)
    elif origin in (list, tuple, set, frozenset):
        yield from _nested(get_args(tp)[0], suffix + "[]")
    elif origin is dict:
        yield from _nested(get_args(tp)[1], suffix + ".<name>")


def _walk(path: str, struct: type[msgspec.Struct], out: dict[str, dict[str, KeyInfo]]) -> None:
    out[path] = struct_keys(struct)
    for f in msgspec.structs.fields(struct):
        child = f"{path}.{f.encode_name}" if path else f.encode_name
        for suffix, sub in _nested(f.type):
            _walk(child + suffix, sub, out)


def config_sections() -> dict[str, dict[str, KeyInfo]]:
    """Every mapping of the config file ('' = the top level) and the keys it takes."""
    out: dict[str, dict[str, KeyInfo]] = {}
    _walk("", ConfigDoc, out)
    out["costModel"] = {k: KeyInfo(k, UNSET) for k in COST_MODEL_KEYS}
    for key, tp in COST_MODEL_KEYS.items():
        for suffix, sub in _nested(tp):
            _walk(f"costModel.{key}{suffix}", sub, out)
    return out


def plugin_infos(registry: PluginRegistry) -> dict[str, PluginInfo]:
    return {
        s.type_name: PluginInfo(s.type_name, s.kind, struct_keys(s.params_type)) for s in registry.types()
    }


def serve_flags(parser: argparse.ArgumentParser) -> list[str]:
    """Every option string of `epp serve` except `-h`/`--help` (argparse lists them only privately)."""
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    serve: argparse.ArgumentParser = sub.choices["serve"]
    return [
        opt
        for action in serve._actions
        if not isinstance(action, argparse._HelpAction)
        for opt in action.option_strings
    ]


# -- what the docs say --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Row:
    line: int
    cells: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Table:
    heading: str  # the nearest heading above, without the #s
    header: tuple[str, ...]  # lower-cased
    rows: tuple[Row, ...]


def _cells(line: str) -> tuple[str, ...]:
    inner = line.strip()
    inner = inner[1:] if inner.startswith("|") else inner
    inner = inner[:-1] if inner.endswith("|") and not inner.endswith("\\|") else inner
    return tuple(c.strip().replace("\\|", "|") for c in _CELL_SPLIT.split(inner))


def tables(text: str) -> list[Table]:
    """The Markdown tables of `text`: a header row, a separator row, then rows until a non-table line."""
    lines = text.splitlines()
    out: list[Table] = []
    heading = ""
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("#"):
            heading = line.lstrip("#").strip()
        is_table = (
            line.lstrip().startswith("|")
            and i + 1 < len(lines)
            and lines[i + 1].lstrip().startswith("|")
            and all(_SEPARATOR.match(c) for c in _cells(lines[i + 1]))
        )
        if not is_table:
            i += 1
            continue
        header = tuple(c.lower() for c in _cells(line))
        rows = []
        i += 2
        while i < len(lines) and lines[i].lstrip().startswith("|"):
            rows.append(Row(i + 1, _cells(lines[i])))
            i += 1
        out.append(Table(heading, header, tuple(rows)))
    return out


def _only_code(cell: str) -> str | None:
    """The text of a cell that is exactly one `code` span, else None."""
    m = re.fullmatch(r"`([^`]+)`", cell.strip())
    return m.group(1) if m else None


def _code_list(cell: str) -> list[str] | None:
    """The spans of a cell that is a comma-separated list of `code` spans (or `—`), else None."""
    if cell.strip().lower() in _NONE_CELLS:
        return []
    if _CODE.sub("", cell).replace(",", "").strip():
        return None
    return _CODE.findall(cell)


def _same_default(documented: str, code: str) -> bool:
    d = documented.strip()
    words = d.split()
    if code in (UNSET, REQUIRED):
        return bool(words) and words[0].lower().strip(",.:;") == code
    spans = _CODE.findall(d)
    if not spans or not d.startswith("`"):
        return False
    first = spans[0].strip()
    try:
        return math.isclose(float(first.replace(",", "").replace("_", "")), float(code), rel_tol=1e-12)
    except ValueError:
        pass
    if first == code:
        return True
    try:
        return bool(yaml.safe_load(first) == yaml.safe_load(code))
    except yaml.YAMLError:
        return False


def _rows(text: str, header_start: Sequence[str]) -> Iterator[Row]:
    """The rows of every table whose header starts with `header_start`."""
    n = len(header_start)
    for t in tables(text):
        if t.header[:n] == tuple(header_start):
            yield from t.rows


def metric_problems(text: str, exposed: Mapping[str, MetricInfo], doc: str = METRICS_DOC) -> list[str]:
    out: list[str] = []
    seen: set[str] = set()
    for r in _rows(text, ("metric", "type", "labels", "meaning")):
        where = f"{doc}:{r.line}"
        if len(r.cells) != 4:
            out.append(f"{where}: expected 4 cells (metric, type, labels, meaning), got {len(r.cells)}")
            continue
        name = _only_code(r.cells[0])
        if name is None:
            out.append(f"{where}: the metric cell must be the metric's name in `code`, got {r.cells[0]!r}")
            continue
        if name in seen:
            out.append(f"{where}: `{name}` is documented twice")
        seen.add(name)
        info = exposed.get(name)
        if info is None:
            out.append(f"{where}: `{name}` is documented but the EPP exposes no such metric")
            continue
        if r.cells[1].strip().lower() != info.type:
            out.append(f"{where}: `{name}` is a {info.type}, documented as {r.cells[1]!r}")
        labels = _code_list(r.cells[2])
        if labels is None:
            out.append(f"{where}: `{name}`: the labels cell must list label names in `code` (or —)")
        elif len(set(labels)) != len(labels) or frozenset(labels) != info.labels:
            out.append(f"{where}: `{name}` has labels {_names(info.labels)}, documented {_names(labels)}")
        if not r.cells[3].strip():
            out.append(f"{where}: `{name}` has no meaning")
    for name in sorted(set(exposed) - seen):
        info = exposed[name]
        out.append(
            f"{doc}: `{name}` ({info.type}, labels {_names(info.labels)}) is not documented; add "
            f"| `{name}` | {info.type} | {', '.join(f'`{x}`' for x in sorted(info.labels)) or '—'} | ... |"
        )
    return out


def _names(labels: Collection[str]) -> str:
    return ", ".join(sorted(labels)) or "none"


def _section_of(heading: str) -> str | None:
    if heading == TOP_LEVEL:
        return ""
    return _only_code(heading)


def _label(section: str) -> str:
    return f"`{section}`" if section else "the top level"


def _key_problems(where: str, what: str, row: Row, keys: Mapping[str, KeyInfo], seen: set[str]) -> list[str]:
    """A `| key | default | meaning |`-shaped row (cells from index 0) checked against `keys`."""
    out: list[str] = []
    key = _only_code(row.cells[0])
    if key is None:
        return [f"{where}: the key cell must be the key in `code`, got {row.cells[0]!r}"]
    if key in seen:
        out.append(f"{where}: {what} `{key}` is documented twice")
    seen.add(key)
    info = keys.get(key)
    if info is None:
        return [*out, f"{where}: {what} `{key}` is documented but not accepted by the code"]
    if not _same_default(row.cells[1], info.default):
        expected = info.default if info.default in (UNSET, REQUIRED) else f"`{info.default}`"
        out.append(f"{where}: {what} `{key}` defaults to {expected}, documented {row.cells[1]!r}")
    if not row.cells[2].strip():
        out.append(f"{where}: {what} `{key}` has no meaning")
    return out


def section_problems(
    text: str, sections: Mapping[str, Mapping[str, KeyInfo]], doc: str = CONFIG_DOC
) -> list[str]:
    out: list[str] = []
    documented: dict[str, set[str]] = {}
    for t in tables(text):
        if t.header != ("key", "default", "meaning"):
            continue
        section = _section_of(t.heading)
        if section is None:
            line = t.rows[0].line - 2 if t.rows else 0
            out.append(
                f"{doc}:{line}: a key table must sit under `### {TOP_LEVEL}` or a heading that is "
                f"the section path in `code`, found {t.heading!r}"
            )
            continue
        if section in documented:
            out.append(f"{doc}: section {_label(section)} has two key tables")
        if section not in sections:
            out.append(f"{doc}: section {_label(section)} is documented but the config has no such section")
            continue
        seen = documented.setdefault(section, set())
        for r in t.rows:
            where = f"{doc}:{r.line}"
            if len(r.cells) != 3:
                out.append(f"{where}: expected 3 cells (key, default, meaning), got {len(r.cells)}")
                continue
            out += _key_problems(
                where, f"{section} key" if section else "top-level key", r, sections[section], seen
            )
    for section, keys in sections.items():
        if section not in documented:
            heading = TOP_LEVEL if not section else f"`{section}`"
            out.append(
                f'{doc}: config section {_label(section)} has no key table (add one under "### {heading}")'
            )
            continue
        for key in sorted(set(keys) - documented[section]):
            out.append(
                f"{doc}: {_label(section)} key `{key}` is not documented; add "
                f"| `{key}` | {_doc_default(keys[key])} | ... |"
            )
    return out


def _doc_default(info: KeyInfo) -> str:
    return info.default if info.default in (UNSET, REQUIRED) else f"`{info.default}`"


def plugin_problems(text: str, plugins: Mapping[str, PluginInfo], doc: str = CONFIG_DOC) -> list[str]:
    out: list[str] = []
    listed: set[str] = set()
    for r in _rows(text, ("type", "kind")):
        where = f"{doc}:{r.line}"
        name = _only_code(r.cells[0])
        if name is None:
            out.append(f"{where}: the type cell must be the plugin type in `code`, got {r.cells[0]!r}")
            continue
        if name in listed:
            out.append(f"{where}: plugin `{name}` is listed twice")
        listed.add(name)
        info = plugins.get(name)
        if info is None:
            out.append(f"{where}: plugin `{name}` is documented but not registered")
        elif len(r.cells) < 3 or not r.cells[2].strip():
            out.append(f"{where}: plugin `{name}` needs a kind and what it does")
        elif r.cells[1].strip() != info.kind:
            out.append(f"{where}: plugin `{name}` is a {info.kind}, documented {r.cells[1]!r}")
    for name in sorted(set(plugins) - listed):
        out.append(f"{doc}: plugin `{name}` ({plugins[name].kind}) is not in the plugin table")
    seen: dict[str, set[str]] = {}
    for r in _rows(text, ("plugin", "parameter", "default", "meaning")):
        where = f"{doc}:{r.line}"
        if len(r.cells) != 4:
            out.append(f"{where}: expected 4 cells (plugin, parameter, default, meaning), got {len(r.cells)}")
            continue
        name = _only_code(r.cells[0])
        plugin = plugins.get(name or "")
        if plugin is None:
            out.append(f"{where}: parameter of {r.cells[0]!r}, which is not a registered plugin type")
            continue
        out += _key_problems(
            where,
            f"{name} parameter",
            Row(r.line, r.cells[1:]),
            plugin.params,
            seen.setdefault(name or "", set()),
        )
    for name, plugin in sorted(plugins.items()):
        for key in sorted(set(plugin.params) - seen.get(name, set())):
            out.append(
                f"{doc}: parameter `{key}` of `{name}` is not documented; add "
                f"| `{name}` | `{key}` | {_doc_default(plugin.params[key])} | ... |"
            )
    return out


def flag_problems(docs: Mapping[str, str], flags: Collection[str], config_doc: str = CONFIG_DOC) -> list[str]:
    """Every flag appears in some doc; a flag in the flags table of `config_doc` exists."""
    out: list[str] = []
    every = "\n".join(docs.values())
    for flag in flags:
        if not re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", every):
            out.append(f"`epp serve {flag}` is in no doc ({', '.join(sorted(docs))})")
    for r in _rows(docs.get(config_doc, ""), ("flag",)):
        for flag in _FLAG.findall(r.cells[0]):
            if flag not in flags:
                out.append(f"{config_doc}:{r.line}: `{flag}` is documented but `epp serve` has no such flag")
    return out


def read_docs(root: pathlib.Path = ROOT) -> dict[str, str]:
    """docs/*.md and README.md by path relative to `root`."""
    paths = [*sorted((root / "docs").glob("*.md")), root / "README.md"]
    return {str(p.relative_to(root)): p.read_text(encoding="utf-8") for p in paths if p.is_file()}


def problems(root: pathlib.Path = ROOT) -> list[str]:
    from epp.cli import build_parser
    from epp.scheduling.builtin import default_registry

    docs = read_docs(root)
    return [
        *metric_problems(docs.get(METRICS_DOC, ""), exposed_metrics()),
        *section_problems(docs.get(CONFIG_DOC, ""), config_sections()),
        *plugin_problems(docs.get(CONFIG_DOC, ""), plugin_infos(default_registry())),
        *flag_problems(docs, serve_flags(build_parser())),
    ]


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m epp.docs_reference",
        description="Check docs/metrics.md and docs/configuration.md against the code.",
    )
    p.add_argument("--root", type=pathlib.Path, default=ROOT, help="the repository (default: this checkout)")
    args = p.parse_args(argv)
    found = problems(args.root)
    for line in found:
        print(line)
    if found:
        print(f"{len(found)} problem(s): the references disagree with the code", file=sys.stderr)
        return 1
    print("docs/metrics.md and docs/configuration.md agree with the code")
    return 0


if __name__ == "__main__":
    sys.exit(main())
