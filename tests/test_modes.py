"""A run's mode is `common.modes.Mode`, defined once: no product module compares a mode to a string or lists the
modes' names again (issue 55). Pure `ast` over the sources, as tests/test_layout.py reads them."""

from __future__ import annotations

import ast

from common.modes import MODES, Mode
from common.settings import TreeConfig
from engine.config import RunConfig
from tests.test_layout import PACKAGES, _modules

PRODUCT = PACKAGES


def _name(node) -> str | None:
    """A name, an attribute's, or a subscript's string key (`row["mode"]`)."""
    if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant) and isinstance(node.slice.value, str):
        return node.slice.value
    return node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else None


def _is_mode(node) -> bool:
    """`mode`, `run_mode`, `self.mode`, `row["mode"]`...: what holds a run's mode (not `chat_mode`: a template's)."""
    name = _name(node) or ""
    return name == "mode" or (name.endswith("_mode") and name != "chat_mode")


def _strings(node) -> list[str]:
    """The string constants a comparison's operand is (one, or a tuple, list or set of them)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return [e.value for e in node.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)]
    return []


def _product_trees():
    for name, path in _modules().items():
        if name.split(".")[0] in PRODUCT:
            yield path, ast.parse(path.read_text())


def test_no_product_code_compares_a_mode_to_a_string():
    found = []
    for path, tree in _product_trees():
        for node in ast.walk(tree):
            if isinstance(node, ast.Compare):
                operands = [node.left, *node.comparators]
                if any(map(_is_mode, operands)) and any(_strings(x) for x in operands):
                    found.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
    assert not found, found


def test_the_modes_are_listed_once():
    """No tuple of two or more mode names outside common/modes.py (the set of modes, or a part of it, kept twice)."""
    names, found = set(MODES), []
    for path, tree in _product_trees():
        if path.name == "modes.py":
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
                s = _strings(node)
                if len(s) >= 2 and len(s) == len(node.elts) and set(s) <= names:
                    found.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
    assert not found, found


def test_an_option_s_text_becomes_the_member():
    assert RunConfig(mode="stdpl", memory_budget="1GiB").mode is Mode.STDPL
    assert RunConfig.from_options(mode="chain").tree.mode is Mode.CHAIN
    assert TreeConfig(mode="chain").mode is Mode.CHAIN and TreeConfig().mode is Mode.TREE
