"""Generate the SpeculativeDeployment CRD from the pydantic models in `ddtree_operator.api`.

    python -m ddtree_operator.crd            # (re)write crds/ and the chart's copy
    python -m ddtree_operator.crd --check    # exit 1 when a committed file differs from the models

pydantic emits JSON Schema with $refs, nullable unions and titles; a CRD needs a *structural* OpenAPI
v3 schema (everything inlined, no nulls, no `additionalProperties: false`), so `structural()` rewrites it.
"""

from __future__ import annotations

import argparse
import copy
import pathlib
import sys
from typing import Any

import pydantic
import yaml

from . import api

CRD_NAME = f"{api.PLURAL}.{api.GROUP}"
REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]
CRD_FILE = REPO_ROOT / "crds" / f"{api.GROUP}_{api.PLURAL}.yaml"
CHART_CRD_FILE = REPO_ROOT / "charts" / "ddtree" / "templates" / "crd.yaml"

# metadata is not part of the pydantic models, so the name rule lives here.
NAME_RULE = {
    "rule": "self.metadata.name.matches('^[a-z]([-a-z0-9]*[a-z0-9])?$') && self.metadata.name.size() <= 63",
    "message": "metadata.name must be a DNS-1035 label (lower case, starts with a letter, at most 63 "
    "characters): it also names the Deployment and the Service",
}

PRINTER_COLUMNS = [
    {"name": "Ready", "type": "integer", "jsonPath": ".status.readyReplicas", "description": "Ready engine pods"},
    {"name": "Replicas", "type": "integer", "jsonPath": ".spec.replicas", "description": "Desired engine pods"},
    {"name": "Method", "type": "string", "jsonPath": ".spec.speculation.method"},
    {"name": "Budget", "type": "string", "jsonPath": ".spec.speculation.budget"},
    {
        "name": "AccLen",
        "type": "number",
        "jsonPath": ".status.acceptanceLength",
        "description": "Windowed mean acceptance length",
    },
    {
        "name": "Tok/s",
        "type": "number",
        "jsonPath": ".status.throughputTokensPerSecond",
        "description": "Generated tokens per second, all ready pods",
    },
    {"name": "Phase", "type": "string", "jsonPath": ".status.phase"},
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
    {"name": "Model", "type": "string", "jsonPath": ".spec.model.uri", "priority": 1},
    {"name": "Reason", "type": "string", "jsonPath": '.status.conditions[?(@.type=="Ready")].reason', "priority": 1},
]

# Keys a CRD schema may carry; everything else pydantic emits (title, $defs, ...) is dropped.
_KEEP = {
    "type",
    "format",
    "description",
    "default",
    "enum",
    "pattern",
    "minimum",
    "maximum",
    "exclusiveMinimum",
    "exclusiveMaximum",
    "minLength",
    "maxLength",
    "minItems",
    "maxItems",
    "properties",
    "required",
    "items",
    "additionalProperties",
    "x-kubernetes-validations",
    "x-kubernetes-int-or-string",
    "x-kubernetes-preserve-unknown-fields",
    "x-kubernetes-list-type",
    "x-kubernetes-list-map-keys",
}


def structural(node: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    """Rewrite one pydantic JSON-schema node into a structural OpenAPI v3 node."""
    node = dict(node)
    if "$ref" in node:  # inline the referenced definition; siblings (default, description) win
        target = defs[node.pop("$ref").rsplit("/", 1)[-1]]
        node = {**target, **node}
    if "anyOf" in node:  # `X | None` -> X (optional fields are simply not `required`)
        branches = [b for b in node.pop("anyOf") if b.get("type") != "null"]
        if len(branches) != 1:
            raise ValueError(f"cannot express a union of {branches} in a structural schema")
        node = {**branches[0], **node}
        if "$ref" in node:
            return structural(node, defs)
    if node.get("default", ...) is None:
        del node["default"]
    if node.get("x-kubernetes-int-or-string"):
        # The one union structural schemas allow (as core/v1 Quantity does).
        node["anyOf"] = [{"type": "integer"}, {"type": "string"}]
        node.pop("type", None)
    for bound, limit in (("exclusiveMinimum", "minimum"), ("exclusiveMaximum", "maximum")):
        # JSON Schema 2020 gives the exclusive bound as a number, OpenAPI v3.0 as a flag on minimum/maximum.
        if isinstance(node.get(bound), (int, float)) and not isinstance(node[bound], bool):
            node[limit] = node.pop(bound)
            node[bound] = True
    out = {k: v for k, v in node.items() if k in _KEEP or k == "anyOf"}
    if "properties" in out:
        out["type"] = "object"
        out["properties"] = {k: structural(v, defs) for k, v in out["properties"].items()}
        if isinstance(out.get("default"), dict):
            # Defaulting `{}` lets the API server fill the nested defaults of the properties.
            out["default"] = {}
    if out.get("additionalProperties") is False:
        del out["additionalProperties"]
    elif isinstance(out.get("additionalProperties"), dict):
        out["additionalProperties"] = structural(out["additionalProperties"], defs)
    if "items" in out:
        out["items"] = structural(out["items"], defs)
    return out


def _schema_of(model: type[pydantic.BaseModel]) -> dict[str, Any]:
    raw = model.model_json_schema(by_alias=True, mode="validation", ref_template="#/$defs/{model}")
    return structural(raw, raw.get("$defs", {}))


def openapi_schema() -> dict[str, Any]:
    status = _schema_of(api.SpeculativeDeploymentStatus)
    status.pop("x-kubernetes-validations", None)
    return {
        "type": "object",
        "description": "A model served by DDTree speculative-decoding engine pods (see docs/operator.md).",
        "required": ["spec"],
        "properties": {
            "apiVersion": {"type": "string"},
            "kind": {"type": "string"},
            "metadata": {"type": "object"},
            "spec": _schema_of(api.SpeculativeDeploymentSpec),
            "status": status,
        },
        "x-kubernetes-validations": [NAME_RULE],
    }


def crd() -> dict[str, Any]:
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": CRD_NAME},
        "spec": {
            "group": api.GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": api.KIND,
                "listKind": f"{api.KIND}List",
                "plural": api.PLURAL,
                "singular": api.SINGULAR,
                "shortNames": api.SHORT_NAMES,
                "categories": api.CATEGORIES,
            },
            "versions": [
                {
                    "name": api.VERSION,
                    "served": True,
                    "storage": True,
                    "schema": {"openAPIV3Schema": openapi_schema()},
                    "subresources": {
                        "status": {},
                        "scale": {
                            "specReplicasPath": ".spec.replicas",
                            "statusReplicasPath": ".status.replicas",
                            "labelSelectorPath": ".status.selector",
                        },
                    },
                    "additionalPrinterColumns": PRINTER_COLUMNS,
                }
            ],
        },
    }


HEADER = "# Generated by `python -m ddtree_operator.crd` from operator/ddtree_operator/api.py; do not edit.\n"


def render_crd_yaml() -> str:
    return HEADER + yaml.safe_dump(crd(), sort_keys=False, width=120, allow_unicode=True)


def render_chart_crd() -> str:
    """The chart's copy: the same CRD behind `crds.install`, kept on `helm uninstall` (users' objects live in it)."""
    doc = copy.deepcopy(crd())
    doc["metadata"]["annotations"] = {"helm.sh/resource-policy": "keep"}
    body = yaml.safe_dump(doc, sort_keys=False, width=120, allow_unicode=True)
    return HEADER + "{{- if .Values.crds.install }}\n" + body + "{{- end }}\n"


def generated_files() -> dict[pathlib.Path, str]:
    return {CRD_FILE: render_crd_yaml(), CHART_CRD_FILE: render_chart_crd()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ddtree_operator.crd", description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="fail when the committed files are out of date")
    args = parser.parse_args(argv)
    stale = []
    for path, text in generated_files().items():
        current = path.read_text() if path.exists() else None
        if current == text:
            continue
        if args.check:
            stale.append(path)
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            print(f"wrote {path.relative_to(REPO_ROOT)}")
    if stale:
        names = ", ".join(str(p.relative_to(REPO_ROOT)) for p in stale)
        print(f"out of date: {names}; run `python -m ddtree_operator.crd`", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
