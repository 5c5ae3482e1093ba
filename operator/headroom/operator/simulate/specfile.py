"""Read an InferenceDeployment from a file, as `kubectl apply -f` would take it: YAML or JSON,
the whole resource or only its spec, validated by the operator's own models and sized by its
own planner. Every way it can be wrong is a `SpecFileError` naming the file, the line where it
can be found, the field and the reason.

A file is held to what the API server accepts, not to what the operator's models would also
take from Python: fields by their camelCase names only (the models also take the snake_case
ones), no string where the schema has an integer or a boolean (pydantic's lax mode would read
"128" or "off"), no key twice in a mapping (kubectl refuses it), the CRD's apiVersion, no
top-level field its schema lacks, and a metadata.name its rule takes (the file's stem names a
resource without one)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, get_args

import yaml
from pydantic import BaseModel, ValidationError
from pydantic_core import ErrorDetails

from headroom.operator.crd.models import (
    GROUP,
    KIND,
    VERSION,
    InferenceDeploymentSpec,
    name_error,
)
from headroom.operator.crd.rules import rule_field
from headroom.operator.reconcile.sizing import Sizing, parse

API_VERSION = f"{GROUP}/{VERSION}"
# The resource's top level as the CRD's schema declares it (status: kubectl apply drops it).
RESOURCE_KEYS = ("apiVersion", "kind", "metadata", "spec", "status")
_MERGE_TAG = "tag:yaml.org,2002:merge"


class SpecFileError(ValueError):
    """A spec file that cannot be simulated, with where and why."""


@dataclass(frozen=True)
class SpecFile:
    """A validated spec, its sizing, and the resource's name (the file's stem without one)."""

    name: str
    spec: InferenceDeploymentSpec
    sizing: Sizing
    # The spec as the file has it: what a pasted `headroom profile` block goes into.
    raw: dict[str, Any] = field(default_factory=dict, compare=False)


def _at(line: int | None) -> str:
    return f":{line}" if line else ""


def _line_of(node: yaml.Node | None, loc: list[str]) -> int | None:
    """The 1-based line of the deepest key of `loc` found in a composed YAML document (its last
    occurrence: the one a merge key `<<` leaves in force)."""
    line = None
    for key in loc:
        if not isinstance(node, yaml.MappingNode):
            break
        match = next((kv for kv in reversed(node.value) if kv[0].value == key), None)
        if match is None:
            break
        line, node = match[0].start_mark.line + 1, match[1]
    return line


def _duplicate(root: yaml.Node, where: str) -> None:
    """Refuse a mapping anywhere in `root` that repeats a key, as kubectl does (YAML's own
    loader keeps the last). Called before construction, which rewrites merged mappings."""
    stack: list[tuple[yaml.Node, list[str]]] = [(root, [])]
    seen: set[int] = set()
    while stack:
        node, path = stack.pop()
        if id(node) in seen:  # an alias, possibly of a node that holds itself
            continue
        seen.add(id(node))
        children: list[tuple[yaml.Node, list[str]]] = []
        if isinstance(node, yaml.MappingNode):
            first: dict[tuple[str, str], int] = {}
            for key, value in node.value:
                name = str(key.value) if isinstance(key, yaml.ScalarNode) else "?"
                if isinstance(key, yaml.ScalarNode) and key.tag != _MERGE_TAG:
                    line = key.start_mark.line + 1
                    if (key.tag, key.value) in first:
                        field = ".".join([*path, name])
                        raise SpecFileError(
                            f"{where}:{line}: {field}: duplicate key (first at line "
                            f"{first[key.tag, key.value]}); kubectl refuses a mapping that "
                            "repeats a key"
                        )
                    first[key.tag, key.value] = line
                children.append((value, [*path, name]))
        elif isinstance(node, yaml.SequenceNode):
            children = [(v, [*path, str(i)]) for i, v in enumerate(node.value)]
        stack.extend(reversed(children))  # depth first, in the file's order


def _construct(node: yaml.Node) -> Any:
    loader = yaml.SafeLoader("")
    try:
        return loader.construct_document(node)
    finally:
        loader.dispose()


class _DuplicateKey(Exception):
    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key


def _unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _DuplicateKey(key)
        out[key] = value
    return out


def _json_node(text: str) -> yaml.Node | None:
    """The JSON document composed as YAML, for the lines of its keys (None if PyYAML cannot
    read it). A tab in JSON that `json` accepted is whitespace (a string holds `\\t`), and
    PyYAML refuses tabs there, so they become spaces: the lines stay where they are."""
    try:
        nodes = list(yaml.compose_all(text.replace("\t", " "), Loader=yaml.SafeLoader))
    except (yaml.YAMLError, RecursionError):
        return None
    return nodes[0] if len(nodes) == 1 and isinstance(nodes[0], yaml.MappingNode) else None


def _json(text: str, where: str) -> tuple[dict[str, Any], yaml.Node | None]:
    """A JSON document; json.JSONDecodeError where it is not JSON."""
    try:
        doc = json.loads(text, object_pairs_hook=_unique)
    except _DuplicateKey as exc:
        node = _json_node(text)
        if node is not None:
            _duplicate(node, where)
        raise SpecFileError(
            f"{where}: {exc.key}: duplicate key; kubectl refuses a mapping that repeats a key"
        ) from None
    except json.JSONDecodeError:
        raise
    except RecursionError:
        raise SpecFileError(f"{where}: not JSON this reads: nested too deeply") from None
    except ValueError as exc:  # an integer of more digits than Python converts
        raise SpecFileError(f"{where}: not JSON this reads: {str(exc).split(':')[0]}") from None
    return _mapping(doc, where), _json_node(text)


def _yaml(
    text: str, where: str, json_error: json.JSONDecodeError | None
) -> list[tuple[yaml.Node, Any]]:
    """(node, value) of each document that is not null; on a syntax error, `json_error` if the
    file looked like JSON."""
    try:
        nodes = list(yaml.compose_all(text, Loader=yaml.SafeLoader))
        for node in nodes:
            _duplicate(node, where)
        docs = [(node, _construct(node)) for node in nodes]
    except (yaml.YAMLError, RecursionError) as exc:
        if json_error is not None:
            at, msg = json_error.lineno, json_error.msg
            raise SpecFileError(f"{where}:{at}: not JSON: {msg}") from None
        if isinstance(exc, RecursionError):
            raise SpecFileError(f"{where}: not YAML this reads: nested too deeply") from None
        if isinstance(exc, yaml.MarkedYAMLError):
            mark = exc.problem_mark
            line = mark.line + 1 if mark is not None else None
            raise SpecFileError(f"{where}{_at(line)}: not YAML or JSON: {exc.problem}") from None
        raise SpecFileError(f"{where}: not YAML or JSON: {exc}") from None
    return [(n, d) for n, d in docs if d is not None]


def _document(text: str, where: str) -> tuple[dict[str, Any], yaml.Node | None]:
    json_error = None
    if text.lstrip().startswith("{"):
        # JSON as JSON: PyYAML refuses the tab indentation JSON tools often write. What is not
        # JSON may still be YAML in flow style ({model: {preset: ...}}).
        try:
            return _json(text, where)
        except json.JSONDecodeError as exc:
            json_error = exc
    docs = _yaml(text, where, json_error)
    picked = [i for i, (_, d) in enumerate(docs) if isinstance(d, dict) and d.get("kind") == KIND]
    if len(docs) == 1 and not picked:
        picked = [0]
    if len(picked) != 1:
        raise SpecFileError(
            f"{where}: expected one {KIND} (or its spec), found {len(picked)} among "
            f"{len(docs)} documents"
        )
    node, doc = docs[picked[0]]
    return _mapping(doc, where), node


def _mapping(doc: object, where: str) -> dict[str, Any]:
    if not isinstance(doc, dict):
        kind = type(doc).__name__
        raise SpecFileError(f"{where}: expected a mapping (an {KIND} or its spec), got a {kind}")
    return doc


def _as_sent(doc: Any) -> None:
    """Integral floats become integers, in place: kubectl sends `4.0` as JSON's `4`, which the
    API server takes for an integer field (and pydantic's strict mode would not)."""
    stack = [doc]
    seen: set[int] = set()
    while stack:
        value = stack.pop()
        if id(value) in seen:
            continue
        seen.add(id(value))
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for key, item in list(items):
            if isinstance(item, float) and item.is_integer():
                value[key] = int(item)
            elif isinstance(item, dict | list):
                stack.append(item)


def _alias(loc: tuple[int | str, ...]) -> str | None:
    """The camelCase name of the field whose Python (snake_case) name ends `loc`."""
    model: type[BaseModel] | None = InferenceDeploymentSpec
    for part in loc[:-1]:
        assert model is not None
        field = next((f for f in model.model_fields.values() if f.alias == part), None)
        if field is None:
            return None
        kinds = (field.annotation, *get_args(field.annotation))
        model = next((t for t in kinds if isinstance(t, type) and issubclass(t, BaseModel)), None)
        if model is None:
            return None
    assert model is not None
    field = model.model_fields.get(str(loc[-1]))
    return field.alias if field is not None else None


def _reason(error: ErrorDetails) -> str:
    msg = error["msg"].removeprefix("Value error, ")
    if error["type"] == "extra_forbidden" and error["loc"]:
        alias = _alias(error["loc"])
        if alias is not None:
            return f"{msg} (the API server knows this field only as {alias})"
    if error["type"] in ("int_type", "bool_type", "float_type") and isinstance(error["input"], str):
        return f"{msg}, not the string {error['input']!r}"
    number = error["input"]
    if error["type"] == "int_type" and isinstance(number, float) and math.isfinite(number):
        return f"{msg}, got a number with a fractional part"
    return msg


def _validate(doc: dict[str, Any], where: str, node: yaml.Node | None, prefix: list[str]) -> None:
    """Validate as the API server would: by camelCase name only, and strictly typed."""
    try:
        InferenceDeploymentSpec.model_validate(doc, strict=True, by_alias=True, by_name=False)
    except ValidationError as exc:
        errors = exc.errors()
        # An unknown field first: a misspelt one also reads as a missing one.
        error = next((e for e in errors if e["type"] == "extra_forbidden"), errors[0])
        loc = [str(x) for x in error["loc"]]
        reason = _reason(error)
        # A rule over several fields has no loc of its own: its fieldPath names the field.
        line = _line_of(node, prefix + loc + list(rule_field(reason)))
        field = ".".join(["spec", *loc])
        raise SpecFileError(f"{where}{_at(line)}: {field}: {reason}") from None


def _top_level(doc: dict[str, Any], where: str, node: yaml.Node | None) -> None:
    """Refuse a key the CRD's schema does not declare at the resource's top level, as the API
    server's strict field validation (kubectl's default) does."""
    for key in doc:
        if key not in RESOURCE_KEYS:
            line = _line_of(node, [str(key)])
            raise SpecFileError(
                f"{where}{_at(line)}: {key}: field not declared in the {KIND} schema (it takes "
                f"{', '.join(RESOURCE_KEYS)})"
            )


def _name(meta: object, where: str, node: yaml.Node | None) -> str | None:
    """metadata.name, held to the CRD's rule; None where the file leaves it out (the file's
    stem names the simulated deployment)."""
    if meta is None:
        return None
    if not isinstance(meta, dict):
        line = _line_of(node, ["metadata"])
        raise SpecFileError(
            f"{where}{_at(line)}: metadata must be a mapping, got a {type(meta).__name__}"
        )
    name = meta.get("name")
    if name is None:
        return None
    line = _line_of(node, ["metadata", "name"])
    if not isinstance(name, str):
        raise SpecFileError(f"{where}{_at(line)}: metadata.name must be a string, got {name!r}")
    error = name_error(name)
    if error is not None:
        raise SpecFileError(f"{where}{_at(line)}: {error}, got {name!r}")
    return name


def read_spec(path: Path) -> SpecFile:
    """The spec in `path`, validated and sized; raises SpecFileError."""
    where = str(path)
    try:
        text = path.read_text(encoding="utf-8-sig")
    except (OSError, UnicodeDecodeError) as exc:
        raise SpecFileError(f"{where}: cannot read: {exc}") from None
    doc, node = _document(text, where)
    name = path.stem
    prefix: list[str] = []
    if "kind" in doc or "spec" in doc or "apiVersion" in doc:
        if doc.get("kind", KIND) != KIND:
            line = _line_of(node, ["kind"])
            raise SpecFileError(f"{where}{_at(line)}: kind is {doc.get('kind')!r}, not {KIND}")
        if doc.get("apiVersion", API_VERSION) != API_VERSION:
            line = _line_of(node, ["apiVersion"])
            raise SpecFileError(
                f"{where}{_at(line)}: apiVersion is {doc.get('apiVersion')!r}, not "
                f"{API_VERSION} (the {KIND} CRD's group/version)"
            )
        if not isinstance(doc.get("spec"), dict):
            line = _line_of(node, ["spec"])
            raise SpecFileError(f"{where}{_at(line)}: the {KIND} has no spec mapping")
        _top_level(doc, where, node)
        name = _name(doc.get("metadata"), where, node) or name
        doc, prefix = doc["spec"], ["spec"]
    _as_sent(doc)
    _validate(doc, where, node, prefix)
    parsed = parse(doc)
    if parsed.error is not None:
        line = _line_of(node, prefix + list(parsed.field))
        raise SpecFileError(f"{where}{_at(line)}: {parsed.error}")
    assert parsed.spec is not None and parsed.sizing is not None
    if not parsed.sizing.feasible:
        raise SpecFileError(f"{where}: this pod cannot serve: {parsed.sizing.reason}")
    return SpecFile(name, parsed.spec, parsed.sizing, doc)
