"""Fixtures shared by the unit tests of the torch engine."""

from __future__ import annotations

import pytest
import torch

from dora_rl.modeling import build_tiny_model, load_policy


@pytest.fixture(scope="module")
def sharp_tiny(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    """The tiny 1m model and its tokenizer, its embeddings scaled by 3 so that next-token distributions are
    far from uniform (sampling differences show); one per test module."""
    model, tok = load_policy(build_tiny_model(tmp_path_factory.mktemp("tiny") / "m", "1m", seed=0))
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(3.0)
    return model, tok
