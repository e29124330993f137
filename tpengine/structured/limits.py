"""What a structured-outputs spec may ask, checked in plain Python before any grammar library sees it.

A grammar's parse and compile grow with its size and, for JSON schemas, faster than the cube of their nesting
(xgrammar: 0.04 s at 64 levels, 1 s at 200, 137 s at 1000), so both are bounded. A JSON-schema keyword the library
accepts but does not enforce is refused by name: a request is never told its constraint holds when it does not.
"""
import re

# the longest spec text (a schema's JSON, a regex, an EBNF grammar, the choices together)
MAX_GRAMMAR_CHARS = 64 * 1024
# the deepest nesting of a schema's JSON (a schema inside `properties` counts two levels: the map, then the schema)
MAX_SCHEMA_DEPTH = 128

# keywords xgrammar accepts and ignores (checked against its matcher: it let a violating value through)
UNENFORCED_KEYWORDS = {
    "if": "conditional subschemas (if/then/else)", "then": "conditional subschemas (if/then/else)",
    "else": "conditional subschemas (if/then/else)", "not": "negated subschemas",
    "dependentRequired": "dependent required properties", "dependencies": "dependent properties",
    "$dynamicRef": "dynamic references", "$recursiveRef": "recursive references",
}
# string formats xgrammar enforces; any other format is refused
ENFORCED_FORMATS = frozenset({
    "date", "date-time", "duration", "email", "hostname", "ipv4", "ipv6", "json-pointer", "relative-json-pointer",
    "time", "uri", "uri-reference", "uri-template", "uuid"})
# where a schema holds subschemas: one, a map of them, or a list of them
ONE_SUBSCHEMA = ("items", "additionalProperties", "additionalItems", "contains", "propertyNames",
                 "unevaluatedProperties", "unevaluatedItems", "if", "then", "else", "not")
SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
SUBSCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems", "items")


def check_grammar_size(num_chars: int, what: str) -> None:
    if num_chars > MAX_GRAMMAR_CHARS:
        raise ValueError(f"the {what} has {num_chars} characters, more than the limit of {MAX_GRAMMAR_CHARS}")


def json_depth(value) -> int:
    """How deeply value's JSON nests (a scalar: 0), walked without recursion."""
    deepest, stack = 0, [(value, 0)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict):
            children = node.values()
        elif isinstance(node, list):
            children = node
        else:
            deepest = max(deepest, depth)
            continue
        deepest = max(deepest, depth + 1)
        stack.extend((child, depth + 1) for child in children)
    return deepest


def check_json_schema(schema) -> None:
    """Raise ValueError naming what in schema is over a limit or is a keyword the grammar would not enforce."""
    depth = json_depth(schema)
    if depth > MAX_SCHEMA_DEPTH:
        raise ValueError(f"the json schema nests {depth} levels deep, more than the limit of {MAX_SCHEMA_DEPTH}")
    stack = [(schema, "#")]
    while stack:
        node, where = stack.pop()
        if not isinstance(node, dict):
            continue  # true/false, or a value a keyword of its own checks
        unenforced = _unenforced(node)
        if unenforced is not None:
            raise ValueError(f"the json schema uses {unenforced} at {where}, which structured outputs do not "
                             "enforce")
        for key in ONE_SUBSCHEMA:
            if isinstance(node.get(key), dict):
                stack.append((node[key], f"{where}/{key}"))
        for key in SUBSCHEMA_MAPS:
            if isinstance(node.get(key), dict):
                stack.extend((sub, f"{where}/{key}/{name}") for name, sub in node[key].items())
        for key in SUBSCHEMA_LISTS:
            if isinstance(node.get(key), list):
                stack.extend((sub, f"{where}/{key}/{i}") for i, sub in enumerate(node[key]))


def _unenforced(schema: dict) -> str | None:
    """The first keyword of schema (this level only) that would be accepted and not enforced, described."""
    for key, what in UNENFORCED_KEYWORDS.items():
        if key in schema:
            return f"'{key}' ({what})"
    if schema.get("uniqueItems") is True:
        return "'uniqueItems' (unique array items)"
    if isinstance(schema.get("allOf"), list) and len(schema["allOf"]) > 1:
        return "'allOf' with more than one subschema"
    if "multipleOf" in schema and schema.get("type") != "integer":
        return "'multipleOf' on a non-integer type"
    form = schema.get("format")
    if form is not None and form not in ENFORCED_FORMATS:
        return f"'format': {form!r} (enforced formats: {', '.join(sorted(ENFORCED_FORMATS))})"
    return None


def check_min_tokens_reachable(kind: str, value, min_tokens: int) -> None:
    """A ValueError when a completion held to a choice or regex ends before min_tokens (its text, then its stop
    token) whatever it writes; thinking before the answer (a reasoning model) is not counted here."""
    most = max_text_tokens(kind, value)
    if most is not None and min_tokens > most + 1:
        raise ValueError(f"min_tokens={min_tokens} cannot be met: the {kind} constraint ends a completion after at "
                         f"most {most + 1} tokens")


def max_text_tokens(kind: str, value) -> int | None:
    """The most tokens a completion held to a choice or regex can write before its stop token (a token is at least
    one byte), or None when that is unbounded or not known."""
    if kind == "choice":
        return max(len(choice.encode()) for choice in value)
    if kind == "regex":
        try:
            max_chars = re._parser.parse(value).getwidth()[1]  # Python's reading of the regex; xgrammar's may differ
        except (re.error, RecursionError, OverflowError):
            return None
        return None if max_chars >= re._constants.MAXREPEAT else 4 * max_chars  # UTF-8: at most 4 bytes a character
    return None
