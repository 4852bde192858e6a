"""The staleness rule (C3) is one function, and nothing else in the package restates it."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from dora_rl.config import DoraConfig
from dora_rl.core.staleness import StalenessBound

PACKAGE = Path(__file__).resolve().parents[2]
SOURCES = ["producers", "streams", "consumers", "infra", "schemas", "dora_rl", "bench"]
HOME = PACKAGE / "dora_rl" / "core" / "staleness.py"


@pytest.mark.parametrize(("s", "base", "version", "ok"), [
    (0, 3, 3, True), (0, 3, 2, False), (2, 5, 3, True), (2, 5, 2, False), (2, 3, 4, False), (1, 0, 0, True),
])
def test_allows_is_the_c3_comparison(s: int, base: int, version: int, ok: bool) -> None:
    assert StalenessBound(s).allows(base, version) is ok


def test_derived_facts_agree_with_the_rule() -> None:
    for s in range(4):
        bound = StalenessBound(s)
        for v in range(6):
            allowed = [k for k in range(20) if bound.allows(k, v)]
            assert allowed == list(range(v, bound.deadline(v) + 1))  # deadline = last allowed step
            assert bound.in_window(v + s, v) and not bound.in_window(v + s + 1, v)
        assert bound.violations(5, [5, 4, 3, 2, 6]) == [s_ for s_ in (0, 1, 2, 3, -1) if not 0 <= s_ <= s]


def test_negative_bound_is_refused_by_the_rule_and_the_config() -> None:
    with pytest.raises(ValueError, match="max_staleness"):
        StalenessBound(-1)
    with pytest.raises(ValueError, match="max_staleness"):
        DoraConfig.from_dict({"mode": "dora", "max_staleness": -1})
    assert DoraConfig.from_dict({"mode": "dora", "max_staleness": 2}).staleness_bound == StalenessBound(2)


def _names(node: ast.AST) -> set[str]:
    out: set[str] = set()
    for n in ast.walk(node):
        if isinstance(n, ast.Name):
            out.add(n.id)
        elif isinstance(n, ast.Attribute):
            out.add(n.attr)
    return out


def _is_staleness(name: str) -> bool:
    return name in ("S", "max_staleness")


def _is_config_check(node: ast.expr) -> bool:
    """An operand S may meet outside the rule: a constant (``S < 0``) or the step count (mode defaults)."""
    return isinstance(node, ast.Constant) or _names(node) <= {"self", "config", "steps"}


def _restatements(tree: ast.AST) -> list[int]:
    """Lines comparing S with anything but a constant or the step count (a staleness check), or
    adding S to a version (a deadline)."""
    lines: list[int] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            with_s = [o for o in operands if any(_is_staleness(n) for n in _names(o))]
            if with_s and not all(_is_config_check(o) for o in operands if o not in with_s):
                lines.append(node.lineno)
        elif isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
            names = _names(node)
            if any(_is_staleness(n) for n in names) and any("version" in n for n in names):
                lines.append(node.lineno)
    return lines


def test_no_module_restates_the_comparison() -> None:
    found: dict[str, list[int]] = {}
    for folder in SOURCES:
        for path in sorted((PACKAGE / folder).rglob("*.py")):
            if path == HOME or path.is_symlink() or any(p.is_symlink() for p in path.parents):
                continue
            lines = _restatements(ast.parse(path.read_text(), str(path)))
            if lines:
                found[str(path.relative_to(PACKAGE))] = lines
    assert found == {}, f"the staleness rule restated outside dora_rl/core/staleness.py: {found}"
    assert _restatements(ast.parse(HOME.read_text())), "the checker must see the rule in its home"
