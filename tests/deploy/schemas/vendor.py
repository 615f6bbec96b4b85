"""Writes the CRD schemas the chart's tests validate against, from the upstream CRD files:

    python tests/deploy/schemas/vendor.py ray.io_rayjobs.yaml \
        monitoring.coreos.com_servicemonitors.yaml monitoring.coreos.com_podmonitors.yaml

Each becomes `<kind>.json` here: the served version's openAPIV3Schema without descriptions.
Pod templates become `{"type": "object"}`: the tests check them against the Kubernetes
schema instead (kubernetes-validate), which keeps these files small.
"""

from __future__ import annotations

import json
import os
import sys

import yaml

POD_TEMPLATES = ("template", "submitterPodTemplate")


def slim(node, key: str = ""):
    """A schema `node` without descriptions, its pod templates reduced to plain objects."""
    if isinstance(node, list):
        return [slim(v) for v in node]
    if not isinstance(node, dict):
        return node
    if key in POD_TEMPLATES and "spec" in node.get("properties", {}):
        return {"type": "object"}
    if key == "properties":  # field names, one of which may be "description"
        return {k: slim(v, k) for k, v in node.items()}
    return {k: slim(v, k) for k, v in node.items() if k != "description"}


def main(paths: list[str]) -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    for path in paths:
        with open(path) as f:
            crd = yaml.safe_load(f)
        (version,) = [v for v in crd["spec"]["versions"] if v.get("storage")]
        schema = slim(version["schema"]["openAPIV3Schema"])
        schema["x-source"] = {"crd": crd["metadata"]["name"], "version": version["name"],
                              "annotations": crd["metadata"].get("annotations", {})}
        out = os.path.join(here, crd["spec"]["names"]["kind"].lower() + ".json")
        with open(out, "w") as f:
            json.dump(schema, f, indent=1, sort_keys=True)
            f.write("\n")
        print(out)


if __name__ == "__main__":
    main(sys.argv[1:])
