"""Whether a JSON schema has a finite instance: the one thing about a schema llguidance cannot
tell before a reply is written.

llguidance refuses what is unsatisfiable on its face (`false`, incompatible types, a required
property that is not allowed), but a schema whose every value must contain another value of
itself (`{"$ref": "#"}`, two definitions that refer to each other, an object whose required
property is the object again) compiles into a grammar whose language is empty or infinite:
generation then ends at once (EOS is the only token the mask allows) or never completes. Such a
schema has to be refused with a reason instead.

The test is a least fixpoint over the schema's local `$ref` targets: a target is productive
once it has an instance given the targets already known to; what never becomes productive can
only recurse. Everything else is judged conservatively (assumed satisfiable: strings, numbers,
`not`, keywords llguidance checks itself), so a schema with an instance is never refused here.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

_DEF_KEYS = ("$defs", "definitions")


def unending_refs(schema: Any) -> list[str]:
    """The `$ref`s of `schema` whose targets have no finite instance (sorted), and "#" first
    when the schema itself has none; empty when it has one."""
    targets: dict[str, Any] = {}  # ref -> its target, every local ref the schema holds
    _collect_refs(schema, schema, targets)
    productive: set[str] = set()
    changed = True
    while changed:  # (each pass proves at least one more target, or ends)
        changed = False
        for ref, target in targets.items():
            if ref not in productive and _has_instance(target, targets, productive):
                productive.add(ref)
                changed = True
    unending = sorted(ref for ref in targets if ref not in productive)
    if not _has_instance(schema, targets, productive):
        return ["#", *(ref for ref in unending if ref != "#")]
    return [ref for ref in unending if _reachable(schema, ref, targets)]


def _collect_refs(node: Any, root: Any, targets: dict[str, Any]) -> None:
    stack = [node]
    while stack:
        node = stack.pop()
        if isinstance(node, Mapping):
            ref = node.get("$ref")
            if isinstance(ref, str) and ref not in targets:
                target = _resolve(root, ref)
                if target is not None:
                    targets[ref] = target
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)


def _resolve(root: Any, ref: str) -> Any | None:
    """The target of a local JSON-pointer ref ("#", "#/$defs/x", ...); None otherwise."""
    if not ref.startswith("#"):
        return None  # (remote: llguidance refuses those itself)
    node = root
    for part in ref[1:].split("/")[1:]:
        key = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, Mapping) and key in node:
            node = node[key]
        elif isinstance(node, list) and key.isdigit() and int(key) < len(node):
            node = node[int(key)]
        else:
            return None
    return node


def _has_instance(node: Any, targets: Mapping[str, Any], productive: set[str]) -> bool:
    """Whether `node` has a finite instance, its refs judged by `productive` alone."""
    if isinstance(node, bool) or not isinstance(node, Mapping):
        return node is not False

    def each(key: str) -> Sequence[Any]:
        value = node.get(key)
        return value if isinstance(value, list) else []

    def sub(value: Any) -> bool:
        return _has_instance(value, targets, productive)

    ref = node.get("$ref")
    if isinstance(ref, str) and ref in targets and ref not in productive:
        return False
    if not all(sub(s) for s in each("allOf")):
        return False
    for key in ("anyOf", "oneOf"):
        if each(key) and not any(sub(s) for s in each(key)):
            return False
    if "enum" in node or "const" in node:
        return True
    types = node.get("type")
    kinds = [types] if isinstance(types, str) else types if isinstance(types, list) else None
    if kinds is None or any(k not in ("object", "array") for k in kinds):
        return True  # (a scalar type, or any type: a scalar instance exists)
    if "object" in kinds and _object_has_instance(node, sub):
        return True
    return "array" in kinds and _array_has_instance(node, sub)


def _object_has_instance(node: Mapping[str, Any], sub: Any) -> bool:
    properties = node.get("properties")
    properties = properties if isinstance(properties, Mapping) else {}
    other = node.get("additionalProperties", True)
    required = node.get("required")
    return all(
        sub(properties.get(key, other)) for key in (required if isinstance(required, list) else ())
    )


def _array_has_instance(node: Mapping[str, Any], sub: Any) -> bool:
    least = node.get("minItems", 0)
    least = least if isinstance(least, int) else 0
    prefix = node.get("prefixItems")
    prefix = prefix if isinstance(prefix, list) else []
    if not all(sub(s) for s in prefix[:least]):
        return False
    if least > len(prefix) and not sub(node.get("items", True)):
        return False
    contains = node.get("contains")
    return contains is None or node.get("minContains", 1) == 0 or sub(contains)


def _reachable(schema: Any, ref: str, targets: Mapping[str, Any]) -> bool:
    """Whether `ref` is used by the schema itself, not only inside unused definitions."""
    seen: set[str] = set()
    stack = [_without_defs(schema)]
    while stack:
        node = stack.pop()
        if isinstance(node, Mapping):
            found = node.get("$ref")
            if isinstance(found, str) and found in targets and found not in seen:
                if found == ref:
                    return True
                seen.add(found)
                stack.append(targets[found])
            stack.extend(_without_defs(node).values())
        elif isinstance(node, list):
            stack.extend(node)
    return False


def _without_defs(node: Any) -> Any:
    if not isinstance(node, Mapping):
        return node
    return {k: v for k, v in node.items() if k not in _DEF_KEYS}
