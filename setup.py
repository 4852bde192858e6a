"""Maps the repository's top-level role folders into the single ``dora_rl`` namespace.

``producers/`` -> ``dora_rl.producers``, ``consumers/`` -> ``dora_rl.consumers`` and so on; every
sub-folder with an ``__init__.py`` becomes a sub-package. Nothing is installed under a generic
top-level name.

``dora_rl/<folder>`` is a committed symbolic link to ``../<folder>`` for each role folder, so the
source tree *is* the ``dora_rl`` package as tools see it: mypy (``mypy -p dora_rl``), IDEs and
import-linter follow it without a copy. Packaging still maps each folder explicitly (below), so
the links are never followed twice; ``dora_rl``'s own sub-packages (``dora_rl.core``) are real folders.
"""

from pathlib import Path

from setuptools import setup

ROOT = Path(__file__).parent
ROLE_FOLDERS = ("producers", "consumers", "schemas", "streams", "infra")


DATA = {"schemas": ("*.avsc", "history/*/*.avsc", "golden/*/*.json"),
        "infra": ("broker/kafka/pom.xml", "broker/kafka/*.properties")}
"""Package data, per role folder, as globs relative to it: the Avro schemas with their history and golden samples,
the embedded broker's Maven file and properties."""


def _name(folder: Path) -> str:
    """The ``dora_rl.*`` package name of a folder below the root (``schemas/golden`` -> ``dora_rl.schemas.golden``)."""
    return "dora_rl." + ".".join(folder.relative_to(ROOT).parts)


def _packages() -> tuple[list[str], dict[str, str], dict[str, list[str]]]:
    """Packages, their folders, and their data: a folder that holds data files only (``schemas/golden/Prompt``) is
    declared as a package of its own with its files as its data, as setuptools asks (an undeclared data folder is
    an "importable package absent from the packages configuration", warned once per folder at every install)."""
    packages = ["dora_rl"]
    package_dir = {"dora_rl": "dora_rl"}
    package_data: dict[str, list[str]] = {}
    for init in sorted((ROOT / "dora_rl").glob("*/__init__.py")):
        if not init.parent.is_symlink():
            packages.append(f"dora_rl.{init.parent.name}")
    for folder in ROLE_FOLDERS:
        for init in sorted((ROOT / folder).rglob("__init__.py")):
            name = _name(init.parent)
            packages.append(name)
            package_dir[name] = init.parent.relative_to(ROOT).as_posix()
        for pattern in DATA.get(folder, ()):
            for path in sorted((ROOT / folder).glob(pattern)):
                name = _name(path.parent)
                if name not in package_dir:
                    packages.append(name)
                    package_dir[name] = path.parent.relative_to(ROOT).as_posix()
                package_data.setdefault(name, []).append(path.name)
    return packages, package_dir, package_data


PACKAGES, PACKAGE_DIR, PACKAGE_DATA = _packages()
setup(packages=PACKAGES, package_dir=PACKAGE_DIR, package_data=PACKAGE_DATA)
