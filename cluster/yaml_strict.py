"""YAML as the topology config reads it: PyYAML's safe loader, except that a key given twice in
one mapping is an error. YAML's loaders keep the last one without a word, so a setting pasted
below an older one would silently win or be lost."""

from __future__ import annotations

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


def load(text: str) -> Any:
    """`yaml.safe_load`, with duplicate keys refused."""
    return yaml.load(text, Loader=StrictLoader)  # a SafeLoader: no arbitrary objects
