"""The JSON Schema of the spec language, and its reference page, from the models.

``mpgen schema`` prints :func:`schema_text` (``docs/mpgen-spec.schema.json``,
which the examples name for editors: ``# yaml-language-server:
$schema=...``); ``mpgen schema --markdown`` prints the reference rendered
from it (``reference.py``, ``docs/spec-reference.md``). Both come from
``models.py`` alone, so neither can drift from what the loader accepts.

# NOTE: [A schema of what is written, not of what is held]
# pydantic's own ``model_json_schema()`` describes the models' Python types,
# after the ``mode="before"`` validators have normalised the YAML: it has no
# ``in: x`` (only ``in: [x]``, and under the field's name ``in_`` without
# ``by_alias``), no ``loss: MSELoss``, nothing for the ``Any`` fields that an
# ``AfterValidator`` checks, and keys of keyword arguments unchecked. The
# schema here is of the input language: by alias, in validation mode, every
# form a spec may be written in (the models give each in its annotations;
# NOTE [The JSON Schema of the input language] in ``models.py``), draft
# 2020-12, ``additionalProperties: false`` wherever the models forbid extra
# keys, and keyword arguments as ``patternProperties`` of their names. It may
# be looser than the models where a check is beyond JSON Schema (that a
# mapping in ``in`` is its last item), never stricter.
"""

from __future__ import annotations

import json
import re
from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import GenerateJsonSchema, JsonSchemaValue
from pydantic_core import core_schema

from mpgen.spec_schema.models import FORM, Spec

SCHEMA_ID = "urn:mpgen:spec:1"
DIALECT = "https://json-schema.org/draft/2020-12/schema"
TITLE = "mpgen spec, format version 1"


def spec_json_schema() -> dict:
    """The JSON Schema of a spec file, as the YAML is written."""
    return Spec.model_json_schema(by_alias=True, mode="validation",
                                  schema_generator=_InputLanguage)


def schema_text() -> str:
    """:func:`spec_json_schema` as the text of ``docs/mpgen-spec.schema.json``."""
    return json.dumps(spec_json_schema(), indent=2, sort_keys=True) + "\n"


class _InputLanguage(GenerateJsonSchema):
    """pydantic's generator, for the input language (NOTE [A schema of what is
    written, not of what is held])."""

    def generate(self, schema: core_schema.CoreSchema, mode="validation") -> JsonSchemaValue:
        json_schema = super().generate(schema, mode)
        definitions: dict = {}
        models = _named_forms(json_schema.pop("$defs"), definitions)
        json_schema = _named_forms(json_schema, definitions)
        json_schema["$defs"] = dict(sorted({**models, **definitions}.items()))
        return {"$schema": DIALECT, "$id": SCHEMA_ID, **json_schema, "title": TITLE}

    def field_title_should_be_set(self, schema) -> bool:
        return False  # "Batch Size" for batch_size says nothing

    def get_default_value(self, schema: core_schema.WithDefaultSchema) -> Any:
        factory = schema.get("default_factory")
        if factory is None or schema.get("default_factory_takes_data"):
            return super().get_default_value(schema)
        value = factory()
        if isinstance(value, BaseModel):  # as it would be written: its own keys only
            return value.model_dump(by_alias=True, exclude_defaults=True)
        return value

    def dict_schema(self, schema: core_schema.DictSchema) -> JsonSchemaValue:
        json_schema = super().dict_schema(schema)
        keys = self.generate_inner(schema["keys_schema"]) if "keys_schema" in schema else {}
        if FORM in keys:  # Device, Keyword: pydantic drops a key type without a pattern
            json_schema["propertyNames"] = keys
        return json_schema

    def model_fields_schema(self, schema: core_schema.ModelFieldsSchema) -> JsonSchemaValue:
        json_schema = super().model_fields_schema(schema)
        if "extras_keys_schema" in schema:
            # Keyword arguments: any other key named like one. Not propertyNames,
            # which would hold for the model's own keys too (``in`` is a keyword).
            names = self.generate_inner(schema["extras_keys_schema"])[FORM]["schema"]
            own = "|".join(re.escape(key) for key in json_schema["properties"])
            pattern = f"^(?!(?:{own})$)" + names["pattern"].removeprefix("^")
            json_schema["patternProperties"] = {pattern: json_schema.pop("additionalProperties")}
            json_schema["additionalProperties"] = False
        return json_schema


def _named_forms(node: Any, definitions: dict) -> Any:
    """``node`` with every named form (``models.form``) a ``$ref`` to its
    definition, added to ``definitions``; model docstrings as one line of
    Markdown."""
    if isinstance(node, list):
        return [_named_forms(item, definitions) for item in node]
    if not isinstance(node, dict):
        return node
    node = {key: _named_forms(value, definitions) for key, value in node.items()}
    if isinstance(node.get("description"), str):
        node["description"] = " ".join(node["description"].replace("``", "`").split())
    named = node.pop(FORM, None)
    if named is None:
        return node
    name, form = named["name"], _named_forms(named["schema"], definitions)
    if definitions.setdefault(name, {**form, "title": name}) != {**form, "title": name}:
        raise AssertionError(f"two JSON Schemas named {name!r} in mpgen.spec_schema.models")
    return {"$ref": f"#/$defs/{name}", **node}
