"""Read an InferenceDeployment from a file, as `kubectl apply -f` would take it: YAML or JSON,
the whole resource or only its spec, validated by the operator's own models and sized by its
own planner. Every way it can be wrong is a `SpecFileError` naming the file, the line where it
can be found, the field and the reason."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from headroom.operator.crd.models import KIND, InferenceDeploymentSpec
from headroom.operator.reconcile.sizing import Sizing, parse


class SpecFileError(ValueError):
    """A spec file that cannot be simulated, with where and why."""


@dataclass(frozen=True)
class SpecFile:
    """A validated spec, its sizing, and the resource's name (the file's stem without one)."""

    name: str
    spec: InferenceDeploymentSpec
    sizing: Sizing


def _line_of(node: yaml.Node | None, loc: list[str]) -> int | None:
    """The 1-based line of the deepest key of `loc` found in a composed YAML document."""
    line = None
    for key in loc:
        if not isinstance(node, yaml.MappingNode):
            break
        match = next((kv for kv in node.value if kv[0].value == key), None)
        if match is None:
            break
        line, node = match[0].start_mark.line + 1, match[1]
    return line


def _document(text: str, where: str) -> tuple[dict[str, Any], yaml.Node | None]:
    if text.lstrip().startswith("{"):
        # JSON as JSON: PyYAML refuses the tab indentation JSON tools often write.
        try:
            doc = json.loads(text)
        except json.JSONDecodeError as exc:
            raise SpecFileError(f"{where}:{exc.lineno}: not JSON: {exc.msg}") from None
        except RecursionError:
            raise SpecFileError(f"{where}: not JSON this reads: nested too deeply") from None
        except ValueError as exc:  # an integer of more digits than Python converts
            raise SpecFileError(f"{where}: not JSON this reads: {str(exc).split(':')[0]}") from None
        return _mapping(doc, where), None
    try:
        docs = [d for d in yaml.safe_load_all(text) if d is not None]
        nodes = [n for n in yaml.compose_all(text) if n is not None]
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark
        line = f":{mark.line + 1}" if mark is not None else ""
        raise SpecFileError(f"{where}{line}: not YAML or JSON: {exc.problem}") from None
    except yaml.YAMLError as exc:
        raise SpecFileError(f"{where}: not YAML or JSON: {exc}") from None
    except RecursionError:
        raise SpecFileError(f"{where}: not YAML this reads: nested too deeply") from None
    picked = [i for i, d in enumerate(docs) if isinstance(d, dict) and d.get("kind") == KIND]
    if len(docs) == 1 and not picked:
        picked = [0]
    if len(picked) != 1:
        raise SpecFileError(
            f"{where}: expected one {KIND} (or its spec), found {len(picked)} among "
            f"{len(docs)} documents"
        )
    node = nodes[picked[0]] if len(nodes) == len(docs) else None
    return _mapping(docs[picked[0]], where), node


def _mapping(doc: object, where: str) -> dict[str, Any]:
    if not isinstance(doc, dict):
        kind = type(doc).__name__
        raise SpecFileError(f"{where}: expected a mapping (an {KIND} or its spec), got a {kind}")
    return doc


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
    if "kind" in doc or "spec" in doc:
        if doc.get("kind", KIND) != KIND:
            raise SpecFileError(f"{where}: kind is {doc.get('kind')!r}, not {KIND}")
        if not isinstance(doc.get("spec"), dict):
            raise SpecFileError(f"{where}: the {KIND} has no spec mapping")
        meta = doc.get("metadata")
        if isinstance(meta, dict) and isinstance(meta.get("name"), str):
            name = meta["name"]
        doc, prefix = doc["spec"], ["spec"]
    parsed = parse(doc)
    if parsed.error is not None:
        # parse() says "spec.<field path>: reason"; find that field's line in the file.
        field = parsed.error.split(":", 1)[0].split(".")[1:]
        line = _line_of(node, prefix + field)
        raise SpecFileError(f"{where}{f':{line}' if line else ''}: {parsed.error}")
    assert parsed.spec is not None and parsed.sizing is not None
    if not parsed.sizing.feasible:
        raise SpecFileError(f"{where}: this pod cannot serve: {parsed.sizing.reason}")
    return SpecFile(name, parsed.spec, parsed.sizing)
