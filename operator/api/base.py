"""The base of every CRD model: camelCase on the wire, documented fields, CEL rules with Python twins.

A :class:`Rule` is written once and used twice: the CRD generator emits it as an
``x-kubernetes-validations`` entry (the API server enforces it), and :class:`CRDModel` runs its
Python ``check`` when the operator parses an object, so both reject the same objects with the same
message. Transition rules (those using ``oldSelf``) have no Python twin: only the API server sees
the old object.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, GetJsonSchemaHandler, model_validator
from pydantic.alias_generators import to_camel
from pydantic.json_schema import JsonSchemaValue
from pydantic_core import CoreSchema


@dataclass(frozen=True)
class Rule:
    """One CEL validation rule on an object schema, plus the same check in Python.

    ``field_path`` (relative, e.g. ``.topK``) is where the API server reports the error;
    ``check`` receives the parsed model and returns True when the object is valid.
    """

    cel: str
    message: str
    field_path: str | None = None
    check: Callable[[Any], bool] | None = None
    reason: str | None = None  # FieldValueInvalid (default), FieldValueForbidden, ...

    @property
    def is_transition(self) -> bool:
        return "oldSelf" in self.cel

    def to_schema(self) -> dict[str, str]:
        entry = {"rule": self.cel, "message": self.message}
        if self.field_path:
            entry["fieldPath"] = self.field_path
        if self.reason:
            entry["reason"] = self.reason
        return entry


class CRDModel(BaseModel):
    """Base of spec/status models: snake_case in Python, camelCase in YAML, docstrings as descriptions.

    Subclasses list their CEL rules in ``rules``; :meth:`_check_rules` runs their Python twins.
    """

    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        use_attribute_docstrings=True,
        extra="forbid",
        frozen=True,
    )

    rules: ClassVar[tuple[Rule, ...]] = ()

    @model_validator(mode="after")
    def _check_rules(self) -> CRDModel:
        for rule in type(self).rules:
            if rule.check is not None and not rule.check(self):
                where = (rule.field_path or "").lstrip(".")
                raise ValueError(f"{where}: {rule.message}" if where else rule.message)
        return self

    @classmethod
    def __get_pydantic_json_schema__(
        cls, core_schema: CoreSchema, handler: GetJsonSchemaHandler
    ) -> JsonSchemaValue:
        schema = handler(core_schema)
        if cls.rules:
            target = handler.resolve_ref_schema(schema)
            target["x-kubernetes-validations"] = [rule.to_schema() for rule in cls.rules]
        return schema

    def to_k8s(self) -> dict[str, Any]:
        """The object as the API server stores it (camelCase, defaults included, no nulls)."""
        return self.model_dump(by_alias=True, exclude_none=True, mode="json")

    @classmethod
    def from_k8s(cls, data: Any) -> Any:
        """Parse an object read from the API server (camelCase keys)."""
        return cls.model_validate(data or {})
