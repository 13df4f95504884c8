"""A request's structured-output constraint, from whichever field carries it.

OpenAI's ``response_format`` (chat only): ``{"type": "json_object"}`` or
``{"type": "json_schema", "json_schema": {"schema": {...}}}``; vLLM's
``structured_outputs`` object (``{"json": ...}``, ``{"regex": ...}``,
``{"choice": [...]}``, ``{"grammar": ...}``, ``{"json_object": true}``) and
its older ``guided_json``, ``guided_regex``, ``guided_choice`` and
``guided_grammar`` fields. At most one field may carry a constraint.
"""

from __future__ import annotations

from typing import Any

from ..sampling_params import KINDS, StructuredOutputsParams

GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
          "guided_grammar": "grammar"}


def constraint_of(req: Any) -> tuple[StructuredOutputsParams | None, str | None]:
    """``(the constraint, the request field that carried it)``, or ``(None, None)``.
    A ``ValueError`` whose message starts with the field at fault otherwise."""
    found = []
    response_format = getattr(req, "response_format", None)
    if response_format is not None:
        found.append(("response_format", _from_response_format(response_format)))
    if req.structured_outputs is not None:
        found.append(("structured_outputs", _from_object(req.structured_outputs)))
    for name, kind in GUIDED.items():
        if getattr(req, name) is not None:
            found.append((name, {kind: getattr(req, name)}))
    found = [(name, kw) for name, kw in found if kw is not None]
    if not found:
        return None, None
    if len(found) > 1:
        raise ValueError(f"{found[1][0]}: only one structured-output field per request, "
                         f"got {[name for name, _ in found]}")
    name, kw = found[0]
    try:
        return StructuredOutputsParams(**kw), name
    except ValueError as e:
        raise ValueError(f"{name}: {e}") from None


def _from_response_format(fmt: dict[str, Any]) -> dict[str, Any] | None:
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
            raise ValueError("response_format: json_schema needs a 'json_schema' object with a "
                             "'schema'")
        return {"json": spec["schema"]}
    raise ValueError(f"response_format: type must be 'text', 'json_object' or 'json_schema', "
                     f"got {kind!r}")


def _from_object(obj: dict[str, Any]) -> dict[str, Any]:
    unknown = sorted(set(obj) - set(KINDS))
    if unknown:
        raise ValueError(f"structured_outputs: unknown fields {unknown}; allowed: {KINDS}")
    return dict(obj)
