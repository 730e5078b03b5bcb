"""The structured output an OpenAI-style request asks for, in the HTTP front end: OpenAI's
`response_format`, vLLM's `structured_outputs` object and its older `guided_*` fields, each
read into one StructuredOutputs (at most one field may set it), or a 400 naming the field."""

from __future__ import annotations

import json
from typing import Any

from ipc.messages import StructuredOutputs
from pipeline.server.errors import bad


def _schema_text(value: Any, param: str) -> str:
    """A JSON Schema given as an object (or as JSON text) -> its JSON text."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise bad(param, f"{param} is not valid JSON: {exc}") from None
    if not isinstance(value, (dict, bool)):
        raise bad(param, f"{param} must be a JSON Schema (an object)")
    return json.dumps(value)


def _response_format(value: Any) -> StructuredOutputs | None:
    """OpenAI's response_format: text (no constraint), json_object or json_schema."""
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise bad("response_format", "response_format must be an object with a type")
    kind = value["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputs(json_object=True)
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            raise bad("response_format.json_schema",
                      "response_format.json_schema must be an object with a schema")
        return StructuredOutputs(json=_schema_text(spec["schema"],
                                                   "response_format.json_schema.schema"))
    raise bad("response_format.type", "response_format.type must be text, json_object or "
                                      f"json_schema, got {kind!r}")


def _structured_outputs(value: Any) -> StructuredOutputs:
    """vLLM's structured_outputs object: exactly one of json, regex, choice, grammar,
    json_object."""
    if not isinstance(value, dict):
        raise bad("structured_outputs", "structured_outputs must be an object")
    known = {"json", "regex", "choice", "grammar", "json_object"}
    for name in value:
        if name not in known:
            raise bad(f"structured_outputs.{name}", f"structured_outputs.{name} is not "
                      f"supported (use one of {sorted(known)})")
    fields: dict[str, Any] = {}
    if value.get("json") is not None:
        fields["json"] = _schema_text(value["json"], "structured_outputs.json")
    for name in ("regex", "grammar"):
        if value.get(name) is not None:
            if not isinstance(value[name], str):
                raise bad(f"structured_outputs.{name}",
                          f"structured_outputs.{name} must be a string")
            fields[name] = value[name]
    if value.get("choice") is not None:
        fields["choice"] = _choices(value["choice"], "structured_outputs.choice")
    if value.get("json_object") is not None:
        if not isinstance(value["json_object"], bool):
            raise bad("structured_outputs.json_object",
                      "structured_outputs.json_object must be a boolean")
        fields["json_object"] = value["json_object"]
    out = StructuredOutputs(**fields)
    if len(out.kinds()) != 1:
        raise bad("structured_outputs", "structured_outputs must give exactly one of "
                                        f"{sorted(known)}, got {out.kinds() or 'none'}")
    return out


def _choices(value: Any, param: str) -> list[str]:
    if not (isinstance(value, list) and value and all(isinstance(c, str) for c in value)):
        raise bad(param, f"{param} must be a non-empty array of strings")
    return list(value)


def parse_structured(body: dict[str, Any]) -> tuple[StructuredOutputs | None, str]:
    """The request's structured output, from whichever field set it (at most one may):
    (the constraint or None, the field's name)."""
    given = [name for name in ("response_format", "structured_outputs", "guided_json",
                               "guided_regex", "guided_choice", "guided_grammar")
             if body.get(name) is not None]
    if len(given) > 1:
        raise bad(given[1], f"give one structured output, not {' and '.join(given)}")
    if not given:
        return None, "response_format"
    name = given[0]
    value = body[name]
    if name == "response_format":
        return _response_format(value), name
    if name == "structured_outputs":
        return _structured_outputs(value), name
    if name == "guided_json":
        return StructuredOutputs(json=_schema_text(value, name)), name
    if name == "guided_choice":
        return StructuredOutputs(choice=_choices(value, name)), name
    if not isinstance(value, str):
        raise bad(name, f"{name} must be a string")
    if name == "guided_regex":
        return StructuredOutputs(regex=value), name
    return StructuredOutputs(grammar=value), name
