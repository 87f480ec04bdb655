"""JSON schemas read as llama.cpp's json-schema-to-grammar reads them, before llguidance compiles them.

llguidance follows JSON Schema to the letter: an object takes any key it does not declare
unless `additionalProperties` says otherwise, and an integer may have any number of digits.
A small model at temperature 1 then wanders into undeclared keys, or spends its whole
budget on one number. llama.cpp's converter (common/json-schema-to-grammar.cpp), Ollama's
and OpenAI's strict mode do neither, so these rewrites run on every schema first:

- `closed_objects`: an object schema that lists `properties` and says nothing of
  `additionalProperties` (nor `patternProperties`) takes only its declared keys; an
  explicit `additionalProperties` (true, false or a schema) is followed. `bare=True` closes
  an object with no properties too (tool arguments: no parameters is the empty object).
- `bounded_integers`: an integer takes at most 16 digits (llama.cpp's `integral-part`,
  `[0] | [1-9] [0-9]{0,15}`): a side its `minimum` / `maximum` (or the exclusive ones)
  leaves open gets the 16-digit bound, as llama.cpp's `_build_min_max_int`; a given bound
  is kept as written (llguidance builds the range from it).
"""

from __future__ import annotations

import math
from typing import Any, Mapping

__all__ = ["as_llama_cpp", "closed_objects", "bounded_integers", "INTEGER_DIGITS", "INTEGER_CAP"]

INTEGER_DIGITS = 16  # llama.cpp's integral-part: [1-9] [0-9]{0,15}
INTEGER_CAP = 10 ** INTEGER_DIGITS - 2  # the largest float below 10**16 (see _bound)

# where subschemas sit: a name -> schema map, a list of schemas, or one schema
_MAPS = ("properties", "$defs", "definitions", "patternProperties", "dependentSchemas")
_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_ONE = ("items", "additionalProperties", "if", "then", "else", "contains", "propertyNames",
        "unevaluatedProperties", "additionalItems")
# `not` is left as written: closing or bounding inside it would widen what it excludes


def as_llama_cpp(schema: Any, *, bare_objects: bool = False) -> Any:
    """`schema` with objects closed (closed_objects) and integers bounded (bounded_integers)."""
    return _walk(schema, bare_objects)


def closed_objects(schema: Any, *, bare: bool = False) -> Any:
    """`schema` with each object that lists properties (every object, `bare`) closed to them."""
    return _walk(schema, bare, integers=False)


def bounded_integers(schema: Any) -> Any:
    """`schema` with each integer's open side bounded to INTEGER_DIGITS digits."""
    return _walk(schema, False, objects=False)


def _walk(schema: Any, bare: bool, *, objects: bool = True, integers: bool = True,
          in_all_of: bool = False) -> Any:
    if not isinstance(schema, Mapping):
        return schema
    out: dict = {}
    for key, value in schema.items():
        if key in _MAPS and isinstance(value, Mapping):
            value = {k: _walk(v, bare, objects=objects, integers=integers) for k, v in value.items()}
        elif key in _LISTS and isinstance(value, list):
            # allOf's parts are intersected: closing one to its own keys would refuse the others'
            value = [_walk(v, bare, objects=objects, integers=integers, in_all_of=key == "allOf")
                     for v in value]
        elif key in _ONE and isinstance(value, Mapping):
            value = _walk(value, bare, objects=objects, integers=integers)
        out[key] = value
    if objects and not in_all_of and _is_object(out, bare) and "additionalProperties" not in out \
            and "patternProperties" not in out and "unevaluatedProperties" not in out:
        out["additionalProperties"] = False
    if integers and _is_integer(out):
        _bound(out)
    return out


def _types(schema: Mapping) -> list:
    t = schema.get("type")
    return t if isinstance(t, list) else [t] if isinstance(t, str) else []


def _is_object(schema: Mapping, bare: bool) -> bool:
    if "properties" in schema:
        return True
    return bare and "object" in _types(schema)


def _is_integer(schema: Mapping) -> bool:
    return "integer" in _types(schema)


def _bound(schema: dict) -> None:
    """Give an integer schema the 16-digit bound on each side it leaves open. llguidance
    holds a bound as a float, where 10**16 - 1 is 10**16 (a 17-digit number would pass):
    the bound is INTEGER_CAP, the nearest float below, and 9999999999999999 alone is lost.
    A side whose other bound has more digits than that is left open (the request asked for
    numbers that long)."""
    low = _number(schema.get("minimum"), schema.get("exclusiveMinimum"))
    high = _number(schema.get("maximum"), schema.get("exclusiveMaximum"))
    if any(b is not None and abs(b) > INTEGER_CAP for b in (low, high)):
        return
    if low is None:
        schema["minimum"] = -INTEGER_CAP
    if high is None:
        schema["maximum"] = INTEGER_CAP


def _number(*values: Any) -> float | int | None:
    """The first of `values` that is a number (a draft-4 boolean exclusiveMinimum is not)."""
    for v in values:
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
            return v
    return None
