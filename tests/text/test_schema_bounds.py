"""engine.text.schema_bounds: which schemas have no finite instance (a `$ref` cycle with no
way out), judged against what llguidance's grammar of the schema accepts."""

from __future__ import annotations

import pytest

from dsaserve.engine.text.schema_bounds import unending_refs

SELF = {"$ref": "#"}
MUTUAL = {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}
REQUIRED_SELF = {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}
NONEMPTY_SELF = {"type": "array", "items": {"$ref": "#"}, "minItems": 1}
ALL_OF_SELF = {"allOf": [{"$ref": "#"}]}
OPTIONAL_LOOP = {
    "type": "object",
    "properties": {"a": {"$ref": "#/$defs/loop"}},
    "$defs": {"loop": {"$ref": "#/$defs/loop"}},
}
TREE = {"type": "object", "properties": {"child": {"$ref": "#"}}}
LINKED_LIST = {
    "type": "object",
    "properties": {"next": {"anyOf": [{"$ref": "#"}, {"type": "null"}]}},
    "required": ["next"],
}
# Without "type" a string is an instance too (JSON Schema's rule, and llguidance's).
UNTYPED = {"properties": {"a": {"$ref": "#"}}, "required": ["a"]}
ESCAPE = {"anyOf": [REQUIRED_SELF, {"type": "integer"}]}
UNUSED_LOOP = {"type": "object", "$defs": {"loop": {"$ref": "#/$defs/loop"}}}


@pytest.mark.parametrize(
    ("schema", "refs"),
    [
        (SELF, ["#"]),
        (MUTUAL, ["#", "#/$defs/a", "#/$defs/b"]),
        (REQUIRED_SELF, ["#"]),
        (NONEMPTY_SELF, ["#"]),
        (ALL_OF_SELF, ["#"]),
        (OPTIONAL_LOOP, ["#/$defs/loop"]),  # (an optional part that could never end)
        (TREE, []),
        (LINKED_LIST, []),
        (UNTYPED, []),
        (ESCAPE, []),
        (UNUSED_LOOP, []),
        (False, ["#"]),
        (True, []),
    ],
)
def test_unending_refs(schema: object, refs: list[str]) -> None:
    assert unending_refs(schema) == refs
