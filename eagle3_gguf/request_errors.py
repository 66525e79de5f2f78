"""A request that fits none of llama-cpp-python's request models, said in one line: where it fails and why.

Pydantic tries every member of a union and reports each member's failure, its loc tagged with the member's name
(`messages.0.ChatCompletionRequestSystemMessage.role`). Its first error is then the first member's, whatever the
request meant: a user message without content read `role: Input should be 'system'`. Here the member the request
meant is found (its literal fields, such as a message's role, matched and its value had the member's shape) and its
own error is told; where none matched, what each member would take.
"""

from __future__ import annotations

from dataclasses import dataclass

MISSING = "missing"  # pydantic's type of a required field's absence: its loc's last item names the field
LITERAL = "literal_error"


@dataclass
class Failure:
    """One of pydantic's errors: `path` the request's own keys and indices, `tags` the union members on the way
    (each at the index into path where it was chosen)."""
    path: list[str | int]
    tags: list[tuple[int, str]]
    kind: str
    msg: str
    expected: str  # a literal's allowed values, as pydantic says them ('system', or 'text' or 'json_object')


def explain(errors: list[dict], body: object) -> str:
    """The line for pydantic's `errors` (ValidationError.errors()) on the request `body`: `where: what`."""
    return _explain([_split(e, body) for e in errors], 0)


def _split(error: dict, body: object) -> Failure:
    """Tell the loc's union tags from the request's own keys by walking the body along it."""
    loc, path, tags, value = list(error["loc"]), [], [], body
    for i, item in enumerate(loc):
        last = i == len(loc) - 1
        if isinstance(item, int) and isinstance(value, list) and item < len(value):
            path.append(item)
            value = value[item]
        elif isinstance(value, dict) and isinstance(item, str) and (item in value or (last and error["type"] == MISSING)):
            path.append(item)
            value = value.get(item)
        else:  # not the request's: the member of a union tried here
            tags.append((len(path), str(item)))
    return Failure(path, tags, error["type"], error["msg"], str((error.get("ctx") or {}).get("expected", "")))


def _explain(failures: list[Failure], depth: int) -> str:
    """`depth`: the union tags already chosen (each failure's first `depth` tags are the same)."""
    first = failures[0]
    if len(first.tags) <= depth:
        return f"{_where(first.path)}: {first.msg}"
    at, _ = first.tags[depth]
    members: dict[str, list[Failure]] = {}
    for f in failures:
        if len(f.tags) > depth and f.tags[depth][0] == at:
            members.setdefault(f.tags[depth][1], []).append(f)
    meant = [fs for fs in members.values() if _meant(fs, at, depth)]
    if meant:  # the member the request meant: its own first failure, within it
        return _explain(min(meant, key=len), depth + 1)
    where = _where(first.path[:at])
    fields = {f.path[at] for fs in members.values() for f in fs if _literal_field(f, at)}
    if len(fields) == 1 and all(any(_literal_field(f, at) for f in fs) for fs in members.values()):
        field = fields.pop()  # each member is told apart by this field (a message's role): which values it takes
        values = [f.expected for fs in members.values() for f in fs if _literal_field(f, at)]
        return f"{_where([*first.path[:at], field])}: should be one of {', '.join(values)}"
    kinds = [next((f.expected for f in fs if f.kind == LITERAL and not _inside(f, at)), name)
             for name, fs in members.items()]
    return f"{where}: should be one of {', '.join(kinds)}"


def _meant(fs: list[Failure], at: int, depth: int) -> bool:
    """The request meant this member: each failure lies within its value and none is a literal field of its own
    (a message's role matched), and where the value is a list, some failure lies deeper than its items (a prompt of
    token ids is not list[str] with wrong items: it is neither of str, list[str])."""
    if not all(_inside(f, at) and not _literal_field(f, at) for f in fs):
        return False
    return not isinstance(fs[0].path[at], int) or any(len(f.path) > at + 1 or len(f.tags) > depth + 1 for f in fs)


def _inside(f: Failure, at: int) -> bool:
    """The failure is within the member's value (its shape fit), not the value itself."""
    return len(f.path) > at


def _literal_field(f: Failure, at: int) -> bool:
    """A literal field of the member itself failed: the request meant another member."""
    return f.kind == LITERAL and len(f.path) == at + 1


def _where(path: list[str | int]) -> str:
    return ".".join(str(p) for p in path) or "body"
