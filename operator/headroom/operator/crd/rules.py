"""Cross-field rules written once: a CEL expression the API server enforces and a Python check
the operator enforces, with the same message. The CRD schema and the pydantic models both read
them, so an object kube-apiserver accepts is an object the operator accepts.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, model_validator
from pydantic.alias_generators import to_camel


@dataclass(frozen=True, slots=True)
class Rule:
    """One `x-kubernetes-validations` entry and its Python twin (`check` returns True if valid)."""

    cel: str
    message: str
    check: Callable[[Any], bool]
    field_path: str | None = None  # where kubectl points the error, e.g. ".minReplicas"
    # False: the model does not apply `check`; the operator refuses the same objects when it
    # sizes them (reconcile/sizing.py's SpecError, whose message can name the values). For a
    # rule about what an engine can run rather than what a spec can say.
    in_model: bool = True


def _add_rules(schema: dict[str, Any], cls: type[BaseModel]) -> None:
    rules: tuple[Rule, ...] = getattr(cls, "__rules__", ())
    if not rules:
        return
    entries = []
    for r in rules:
        entry: dict[str, str] = {"rule": r.cel, "message": r.message}
        if r.field_path:
            entry["fieldPath"] = r.field_path
        entries.append(entry)
    schema["x-kubernetes-validations"] = entries


class CRDModel(BaseModel):
    """Base of every CRD object: camelCase on the wire, unknown fields refused, rules applied."""

    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
        json_schema_extra=_add_rules,
    )
    __rules__: ClassVar[tuple[Rule, ...]] = ()

    @model_validator(mode="after")
    def _apply_rules(self) -> CRDModel:
        for rule in type(self).__rules__:
            if rule.in_model and not rule.check(self):
                raise ValueError(rule.message)
        return self

    def wire(self) -> dict[str, Any]:
        """The object as the API server stores it (camelCase, unset optionals left out)."""
        return self.model_dump(by_alias=True, exclude_none=True, mode="json")

    def merge_patch(self) -> dict[str, Any]:
        """The object as a JSON merge patch: unset optionals are null, which deletes a value a
        previous write left (a stale `reason` once a spec is fixed)."""
        return self.model_dump(by_alias=True, mode="json")


def rule_field(message: str) -> tuple[str, ...]:
    """The field (its `fieldPath`, below the model that holds the rule) a rule's message is
    about; () when no rule has this message or it names no field."""
    stack: list[type[CRDModel]] = list(CRDModel.__subclasses__())
    while stack:
        cls = stack.pop()
        stack.extend(cls.__subclasses__())
        for r in cls.__rules__:
            if r.message == message and r.field_path:
                return tuple(r.field_path.lstrip(".").split("."))
    return ()
