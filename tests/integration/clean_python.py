"""A Python interpreter that has confluent_kafka and fastavro but cannot import dora_rl, for the
standalone examples (``examples/*.py``): they must work for someone who has only the ``.avsc`` files.

A fresh venv of the base interpreter, without pip and without the system's site-packages, whose only
extra path (a ``.pth`` file) is a directory of links to those two packages; run with ``-I`` (no
``PYTHON*`` variables, no script directory, no user site), so neither the repository nor this venv's
editable install of ``dora_rl`` is reachable. :func:`clean_python` proves it before returning.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples"


def clean_python(tmp: Path) -> list[str]:
    """The command prefix (``[python, "-I"]``) of a clean interpreter made under ``tmp``."""
    import confluent_kafka
    import fastavro

    venv, deps = tmp / "clean-venv", tmp / "clean-deps"
    if not venv.exists():
        subprocess.run([getattr(sys, "_base_executable", sys.executable), "-m", "venv", "--without-pip", str(venv)],
                       check=True)
        deps.mkdir()
        site = Path(confluent_kafka.__file__).parent.parent
        for name in ("confluent_kafka", "confluent_kafka.libs", "fastavro"):
            if (site / name).exists():
                (deps / name).symlink_to(site / name)
        assert Path(fastavro.__file__).parent == site / "fastavro"
        next((venv / "lib").glob("python*/site-packages")).joinpath("deps.pth").write_text(f"{deps}\n")
    cmd = [str(venv / "bin" / "python"), "-I"]
    no = subprocess.run([*cmd, "-c", "import dora_rl"], capture_output=True, text=True, cwd=REPO)
    assert no.returncode != 0 and "No module named 'dora_rl'" in no.stderr, "the clean interpreter imports dora_rl"
    yes = subprocess.run([*cmd, "-c", "import confluent_kafka, fastavro"], capture_output=True, text=True, cwd=REPO)
    assert yes.returncode == 0, yes.stderr
    return cmd
