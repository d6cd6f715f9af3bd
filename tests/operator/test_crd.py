"""The CRD is generated from the pydantic models: committed copies must not drift, and the schema
must be structural (the API-server tests check that the server accepts and enforces it)."""

import re
import subprocess
import sys

import yaml

from ddtree_operator import api, crd
from ddtree_operator.api import SpeculativeDeploymentStatus


def test_committed_crds_match_the_models():
    result = subprocess.run([sys.executable, "-m", "ddtree_operator.crd", "--check"], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_chart_copy_is_the_same_crd_kept_on_uninstall():
    standalone = yaml.safe_load(crd.CRD_FILE.read_text())
    chart_text = crd.CHART_CRD_FILE.read_text()
    assert chart_text.splitlines()[1] == "{{- if .Values.crds.install }}"
    chart = yaml.safe_load("\n".join(chart_text.splitlines()[2:-1]))
    assert chart["metadata"].pop("annotations") == {"helm.sh/resource-policy": "keep"}
    assert chart == standalone


def _walk(node, path="$"):
    yield path, node
    if isinstance(node, dict):
        for key, value in node.items():
            yield from _walk(value, f"{path}.{key}")
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _walk(value, f"{path}[{i}]")


def test_schema_is_structural():
    schema = crd.openapi_schema()
    for path, node in _walk(schema):
        if not isinstance(node, dict) or path.endswith((".properties", ".x-kubernetes-validations")):
            continue
        assert "$ref" not in node and "title" not in node and "$defs" not in node, path
        assert node.get("additionalProperties") is not False, path
        if "anyOf" in node:  # the only union a structural schema allows
            assert node.get("x-kubernetes-int-or-string") is True, path
        for bound, limit in (("exclusiveMinimum", "minimum"), ("exclusiveMaximum", "maximum")):
            # OpenAPI v3.0 flags an exclusive bound; a JSON Schema number here would be dropped by the server.
            if bound in node:
                assert node[bound] is True and limit in node, path
    for path, node in _walk(schema):
        if isinstance(node, dict) and "properties" in node and isinstance(node["properties"], dict):
            for name, child in node["properties"].items():
                assert "type" in child or child.get("x-kubernetes-int-or-string"), f"{path}.{name} has no type"


def test_exclusive_bounds_of_the_models_reach_the_schema():
    """A `gt` bound in the models (gpuMemoryUtilization > 0) is enforced by the API server, not lost."""
    engine = crd.openapi_schema()["properties"]["spec"]["properties"]["engine"]["properties"]
    assert engine["gpuMemoryUtilization"]["minimum"] == 0
    assert engine["gpuMemoryUtilization"]["exclusiveMinimum"] is True


def _resolve(schema, json_path: str):
    """The schema node a printer-column/scale JSONPath points at (filters like [?(...)] step into items)."""
    node = schema
    for part in re.sub(r"\[.*?\]", "", json_path).strip(".").split("."):
        if part == "metadata":
            return {"type": "object"}
        node = node["properties"][part]
        if node.get("type") == "array":
            node = node["items"]
    return node


def test_printer_columns_point_at_declared_fields():
    schema = crd.openapi_schema()
    names = [c["name"] for c in crd.PRINTER_COLUMNS if c.get("priority", 0) == 0]
    assert names == ["Ready", "Replicas", "Method", "Budget", "AccLen", "Tok/s", "Phase", "Age"]
    numeric = {"integer", "number"}
    for column in crd.PRINTER_COLUMNS:
        field = _resolve(schema, column["jsonPath"])
        if column["type"] in numeric:
            assert field["type"] in numeric, column


def test_scale_subresource_paths_are_declared():
    version = crd.crd()["spec"]["versions"][0]
    scale = version["subresources"]["scale"]
    schema = version["schema"]["openAPIV3Schema"]
    assert _resolve(schema, scale["specReplicasPath"])["type"] == "integer"
    assert _resolve(schema, scale["statusReplicasPath"])["type"] == "integer"
    assert _resolve(schema, scale["labelSelectorPath"])["type"] == "string"
    assert "status" in version["subresources"]


def test_every_status_field_is_declared():
    # Undeclared status fields are silently pruned by the API server (kopf#527).
    declared = crd.openapi_schema()["properties"]["status"]["properties"]
    assert set(declared) == {f.alias for f in SpeculativeDeploymentStatus.model_fields.values()}


def test_names():
    names = crd.crd()["spec"]["names"]
    assert (names["kind"], names["plural"]) == ("SpeculativeDeployment", api.PLURAL)
    assert names["shortNames"] == ["specdeploy"]
    assert crd.crd()["metadata"]["name"] == "speculativedeployments.ddtree.dev"
