"""Every package ``pip`` installs for the product is imported by something in the repository (issue 34).

A dependency of ``[project] dependencies`` passes when a module of the product, an example or a test imports
one of its top-level names (``importlib.metadata.packages_distributions``); the few installed for another
package's sake are listed in :data:`FOR_ANOTHER` with the reason.
"""

from __future__ import annotations

import ast
import functools
import importlib.metadata as metadata
import re
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SOURCES = ("dora_rl", "producers", "consumers", "schemas", "streams", "infra", "examples", "bench", "tests")
FOR_ANOTHER = {"cramjam": "aiokafka (under Faust) decodes lz4-compressed batches with it"}


def dependencies() -> list[str]:
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    return [re.split(r"[<>=!~\[ ;]", d, maxsplit=1)[0] for d in deps]


@functools.cache
def imported_top_levels() -> frozenset[str]:
    names: set[str] = set()
    for folder in SOURCES:
        for path in (REPO / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Import):
                    names.update(a.name.split(".")[0] for a in node.names)
                elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                    names.add(node.module.split(".")[0])
    return frozenset(names)


def test_every_installed_dependency_is_imported() -> None:
    by_dist: dict[str, set[str]] = {}
    for top, dists in metadata.packages_distributions().items():
        for dist in dists:
            by_dist.setdefault(dist.lower().replace("_", "-"), set()).add(top)
    used = imported_top_levels()
    unused = [d for d in dependencies() if d not in FOR_ANOTHER
              and not by_dist.get(d.lower().replace("_", "-"), set()) & used]
    assert unused == [], f"installed but imported by nothing: {unused}"
    assert set(FOR_ANOTHER) <= set(dependencies()), "a FOR_ANOTHER entry that is no longer a dependency"


def test_the_check_sees_an_unused_dependency() -> None:
    """The check can fail: a distribution no source imports is reported."""
    assert "cramjam" not in imported_top_levels() and "numpy" in imported_top_levels()
