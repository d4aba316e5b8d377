"""JSON schemas the structured-output tests (and `benchmarks.structured_output`) generate
for: twenty shapes, from a bounded string to an order with a `$ref`'d item array (the last,
and largest)."""

NAME = {"type": "string", "minLength": 1, "maxLength": 16}
SHORT = {"type": "string", "maxLength": 24}
AGE = {"type": "integer", "minimum": 0, "maximum": 120}
PERSON = {"type": "object", "properties": {"name": NAME, "age": AGE}, "required": ["name", "age"]}

SCHEMAS = [
    SHORT,
    {"type": "integer", "minimum": 1, "maximum": 100},
    {"type": "boolean"},
    {"type": "string", "enum": ["red", "green", "blue"]},
    {"type": "object", "properties": {"city": NAME}, "required": ["city"]},
    PERSON,
    {"type": "object", "properties": {"name": NAME, "nickname": NAME}, "required": ["name"]},
    {
        "type": "object",
        "properties": {"color": {"enum": ["red", "green"]}, "ok": {"type": "boolean"}},
        "required": ["color", "ok"],
    },
    {
        "type": "object",
        "properties": {"score": {"type": "number", "minimum": 0, "maximum": 1}},
        "required": ["score"],
    },
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
     "minItems": 2, "maxItems": 4},
    {"type": "array", "items": SHORT, "minItems": 1, "maxItems": 3},
    {"type": "object", "properties": {"person": PERSON}, "required": ["person"]},
    {
        "type": "object",
        "properties": {"team": NAME, "members": {"type": "array", "items": PERSON,
                                                  "minItems": 1, "maxItems": 3}},
        "required": ["team", "members"],
    },
    {
        "type": "object",
        "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 999}, "tag": SHORT},
        "required": ["id"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "$defs": {"point": {"type": "object", "properties": {
            "x": {"type": "integer", "minimum": -10, "maximum": 10},
            "y": {"type": "integer", "minimum": -10, "maximum": 10}}, "required": ["x", "y"]}},
        "properties": {"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}},
        "required": ["start", "end"],
    },
    {"type": "object", "properties": {"value": {"anyOf": [SHORT, AGE]}}, "required": ["value"]},
    {
        "type": "object",
        "properties": {"kind": {"const": "animal"}, "legs": {"enum": [2, 4, 6, 8]}},
        "required": ["kind", "legs"],
    },
    {
        "type": "object",
        "properties": {"a": {"type": "object", "properties": {"b": {"type": "object",
            "properties": {"c": SHORT}, "required": ["c"]}}, "required": ["b"]}},
        "required": ["a"],
    },
    {
        "type": "object",
        "$defs": {"person": PERSON},
        "properties": {"author": {"$ref": "#/$defs/person"},
                       "reviewers": {"type": "array", "items": {"$ref": "#/$defs/person"},
                                     "maxItems": 2}},
        "required": ["author", "reviewers"],
    },
    {
        "type": "object",
        "$defs": {"item": {"type": "object", "properties": {
            "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"},
            "qty": {"type": "integer", "minimum": 1, "maximum": 50},
            "price": {"type": "number", "minimum": 0, "maximum": 1000}},
            "required": ["sku", "qty", "price"]}},
        "properties": {
            "order_id": {"type": "integer", "minimum": 1, "maximum": 99999},
            "status": {"enum": ["new", "paid", "shipped"]},
            "items": {"type": "array", "items": {"$ref": "#/$defs/item"},
                      "minItems": 1, "maxItems": 3},
            "note": SHORT,
        },
        "required": ["order_id", "status", "items"],
    },
]  # fmt: skip
