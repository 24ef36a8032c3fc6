"""JSON schemas for the structured-output tests: nested objects, arrays with min/max items, enums,
numbers with bounds, required and optional fields, $defs references. Strings and arrays are
bounded, so that a random-weight model, whose free choice is noise, still closes every value
within the token budget."""


S = lambda props, req=None: {"type": "object", "properties": props, "required": req if req is not None else list(props), "additionalProperties": False}
SHORT = {"type": "string", "maxLength": 6}
SCHEMAS = {
    "string": S({"name": SHORT}),
    "integer_range": S({"age": {"type": "integer", "minimum": 0, "maximum": 120}}),
    "number_range": S({"score": {"type": "number", "minimum": -5, "maximum": 5}}),
    "boolean": S({"ok": {"type": "boolean"}}),
    "enum": S({"color": {"enum": ["red", "green", "blue"]}}),
    "const": S({"kind": {"const": "point"}, "x": {"type": "integer", "minimum": 0, "maximum": 9}}),
    "null": S({"nothing": {"type": "null"}}),
    "optional_fields": S({"a": {"type": "integer", "minimum": 0, "maximum": 9}, "b": SHORT}, ["a"]),
    "string_lengths": S({"code": {"type": "string", "minLength": 2, "maxLength": 4}}),
    "string_pattern": S({"id": {"type": "string", "pattern": "^[a-z]{2,5}-[0-9]{1,3}$"}}),
    "array_bounds": S({"tags": {"type": "array", "items": SHORT, "minItems": 1, "maxItems": 3}}),
    "array_of_enums": S({"days": {"type": "array", "items": {"enum": ["mon", "tue", "wed"]}, "minItems": 2, "maxItems": 4}}),
    "nested_object": S({"user": S({"id": {"type": "integer", "minimum": 1, "maximum": 999}, "name": SHORT})}),
    "three_levels": S({"a": S({"b": S({"c": {"type": "boolean"}})})}),
    "array_of_objects": S({"points": {"type": "array", "maxItems": 2, "minItems": 1, "items": S({"x": {"type": "integer", "minimum": 0, "maximum": 9}, "y": {"type": "integer", "minimum": 0, "maximum": 9}})}}),
    "defs_ref": {"$defs": {"pt": S({"x": {"type": "integer", "minimum": 0, "maximum": 9}})}, **S({"start": {"$ref": "#/$defs/pt"}, "end": {"$ref": "#/$defs/pt"}})},
    "any_of": S({"value": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 99}, {"type": "boolean"}]}}),
    "one_of": S({"shape": {"oneOf": [S({"r": {"type": "integer", "minimum": 1, "maximum": 9}}), S({"w": {"type": "integer", "minimum": 1, "maximum": 9}, "h": {"type": "integer", "minimum": 1, "maximum": 9}})]}}),
    "mixed_required": S({"n": {"type": "integer", "minimum": -9, "maximum": 9}, "s": SHORT, "b": {"type": "boolean"}, "e": {"enum": [1, 2, 3]}}),
    "exclusive_bounds": S({"k": {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 10}}),
    "top_level_array": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 50}, "minItems": 1, "maxItems": 4},
    "top_level_enum": {"enum": ["alpha", "beta", "gamma"]},
    "top_level_boolean": {"type": "boolean"},
    "nullable": S({"maybe": {"type": ["integer", "null"], "minimum": 0, "maximum": 9}}),
    "array_of_arrays": S({"grid": {"type": "array", "minItems": 1, "maxItems": 2, "items": {"type": "array", "minItems": 1, "maxItems": 2, "items": {"type": "boolean"}}}}),
}
