"""The wheel installs one namespace, ``dora_rl``, and every sub-package imports from it."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SUBPACKAGES = ["dora_rl", "dora_rl.producers", "dora_rl.producers.rollout", "dora_rl.consumers",
               "dora_rl.consumers.trainer", "dora_rl.schemas", "dora_rl.streams", "dora_rl.infra",
               "dora_rl.infra.weights"]


def test_wheel_has_one_namespace_and_imports_from_a_clean_directory(tmp_path: Path) -> None:
    out = tmp_path / "dist"
    subprocess.run([sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(out), str(REPO)],
                   check=True, capture_output=True, timeout=300)
    wheel = next(out.glob("dora_rl-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert tops == {"dora_rl"}, f"generic top-level names in the wheel: {tops - {'dora_rl'}}"
    assert "dora_rl/schemas/trajectory.avsc" in names and "dora_rl/infra/broker/kafka/pom.xml" in names
    assert any(n.startswith("dora_rl/schemas/history/v1/") for n in names)
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), str(wheel)],
                   check=True, timeout=300)
    code = ("import importlib, sys\n"
            f"for name in {SUBPACKAGES!r}:\n"
            "    mod = importlib.import_module(name)\n"
            f"    assert mod.__file__.startswith({str(site)!r}), (name, mod.__file__)\n"
            "from dora_rl.schemas.codec import current_schemas\n"
            "assert len(current_schemas()) >= 10\n"
            "print('ok')\n")
    run = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env={"PYTHONPATH": str(site), "PATH": "/usr/bin"},
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr
    cli = subprocess.run([sys.executable, "-m", "dora_rl", "topics", "list"], cwd=tmp_path,
                         env={"PYTHONPATH": str(site), "PATH": "/usr/bin"}, capture_output=True, text=True, timeout=120)
    assert cli.returncode == 0 and "dora.rollout.trajectories" in cli.stdout, cli.stderr
