"""The dataset role's prompt ids (``policy_source.prompt_encoder``) are ``modeling.encode_prompt``'s, with or without
the Hugging Face tokenizer, and the plain path imports neither torch nor transformers."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from dora_rl.modeling import build_tiny_model, encode_prompt, load_tokenizer
from dora_rl.policy_source import prompt_encoder

PROMPTS = ["", "What is 12 + 30?", "  leading and trailing  ", "<bos> in the text <eos>", "tabs\tand\nnewlines",
           "unicode: é ü 数 🙂", "x" * 500]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "m", size="1m", seed=0)


def test_plain_tokenizer_gives_encode_prompts_ids(tiny: Path) -> None:
    tok = load_tokenizer(tiny)
    encode = prompt_encoder(tiny)
    for text in PROMPTS:
        assert encode(text) == encode_prompt(tok, text), text


def test_a_chat_template_goes_through_the_hugging_face_tokenizer(tiny: Path, tmp_path: Path) -> None:
    templated = tmp_path / "templated"
    templated.mkdir()
    for f in tiny.iterdir():
        (templated / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((templated / "tokenizer_config.json").read_text())
    cfg["chat_template"] = ("{% for m in messages %}<bos>{{ m['content'] }}<eos>{% endfor %}"
                            "{% if add_generation_prompt %}A:{% endif %}")
    (templated / "tokenizer_config.json").write_text(json.dumps(cfg))
    tok = load_tokenizer(templated)
    encode = prompt_encoder(templated)
    for text in PROMPTS:
        assert encode(text) == encode_prompt(tok, text), text
    assert encode("hi") != prompt_encoder(tiny)("hi"), "the template was not applied"


def test_the_plain_path_imports_no_model_framework(tiny: Path) -> None:
    code = ("import sys; from dora_rl.policy_source import prompt_encoder; "
            f"ids = prompt_encoder({str(tiny)!r})('1 + 1'); "
            "print(len(ids), sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.split() == ["6", "[]"], out.stdout + out.stderr
