"""YAML as the topology config reads it: PyYAML's safe loader, except that a key given twice in
one mapping is an error (YAML's loaders keep the last one without a word, so a setting pasted
below an older one would silently win or be lost), and that only true and false are booleans,
as in YAML 1.2: `--set speculation.method=off` is the word off, not False."""

from __future__ import annotations

import re
from typing import Any

import yaml


class StrictLoader(yaml.SafeLoader):
    """SafeLoader that refuses duplicate keys (a `yaml.YAMLError`, naming the key and line)."""


def _mapping(loader: StrictLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    seen = []
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=True)
        if key in seen:
            raise yaml.YAMLError(f"the key {key!r} is given twice (line "
                                 f"{key_node.start_mark.line + 1})")
        seen.append(key)
    return loader.construct_mapping(node, deep=deep)


StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _mapping)
_BOOL = "tag:yaml.org,2002:bool"
StrictLoader.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in rules if tag != _BOOL]
    for first, rules in yaml.SafeLoader.yaml_implicit_resolvers.items()}
StrictLoader.add_implicit_resolver(_BOOL, re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"),
                                   list("tTfF"))


def load(text: str) -> Any:
    """`yaml.safe_load`, with duplicate keys refused."""
    return yaml.load(text, Loader=StrictLoader)  # a SafeLoader: no arbitrary objects
