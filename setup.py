"""Maps the repository's top-level role folders into the single ``dora_rl`` namespace.

``producers/`` -> ``dora_rl.producers``, ``consumers/`` -> ``dora_rl.consumers`` and so on; every
sub-folder with an ``__init__.py`` becomes a sub-package. Nothing is installed under a generic
top-level name.
"""

from pathlib import Path

from setuptools import setup

ROOT = Path(__file__).parent
ROLE_FOLDERS = ("producers", "consumers", "schemas", "streams", "infra")


def _packages() -> tuple[list[str], dict[str, str]]:
    packages = ["dora_rl"]
    package_dir = {"dora_rl": "dora_rl"}
    for folder in ROLE_FOLDERS:
        for init in sorted((ROOT / folder).rglob("__init__.py")):
            rel = init.parent.relative_to(ROOT)
            name = "dora_rl." + ".".join(rel.parts)
            packages.append(name)
            package_dir[name] = rel.as_posix()
    return packages, package_dir


PACKAGES, PACKAGE_DIR = _packages()
setup(packages=PACKAGES, package_dir=PACKAGE_DIR)
