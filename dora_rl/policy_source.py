"""Where a role gets the initial policy from: ``tiny:<size>``, ``smollm2``, or a local HF folder.

``tiny:<size>`` is built deterministically from the run seed into ``$DORA_HOME/models`` (every
role on every machine builds the same initial weights, so only *updated* weights ever move).
Building writes into a temporary folder renamed into place, so concurrent roles never see a
half-written model. Nothing here imports torch or transformers unless it builds a model or needs the Hugging
Face tokenizer (:func:`prompt_encoder`): a role that only tokenizes prompts starts in a fraction of a second.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dora_rl.infra.broker.dist import dora_home


def models_dir() -> Path:
    """``$DORA_HOME/models``."""
    path = dora_home() / "models"
    path.mkdir(parents=True, exist_ok=True)
    return path


def resolve_model(spec: str, seed: int = 0) -> Path:
    """A local Hugging Face folder for ``spec`` (built or converted on first use)."""
    if spec.startswith("tiny:"):
        size = spec.split(":", 1)[1] or "1m"
        target = models_dir() / f"tiny-{size}-seed{seed}"
        if not (target / "config.json").exists():
            from dora_rl import modeling

            tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=models_dir()))
            modeling.build_tiny_model(tmp, size=size, seed=seed)
            try:
                os.rename(tmp, target)
            except OSError:  # another role built it first
                shutil.rmtree(tmp, ignore_errors=True)
        return target
    if spec == "smollm2":
        from dora_rl import modeling

        return modeling.prepare_smollm2(models_dir())
    path = Path(spec).expanduser()
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"model {spec!r}: no config.json in {path} (expected tiny:<size>, smollm2, "
                                "or a local Hugging Face model folder)")
    return path


def model_vocab_size(spec: str, seed: int = 0) -> int | None:
    """The vocabulary size in ``spec``'s ``config.json`` (a ``tiny:`` or ``smollm2`` model is built first), or
    None when ``spec`` is a path that does not exist on this host (the model lives only where the trainer
    and the engines run)."""
    import json

    if not (spec.startswith("tiny:") or spec == "smollm2" or (Path(spec).expanduser() / "config.json").exists()):
        return None
    return int(json.loads((resolve_model(spec, seed) / "config.json").read_text())["vocab_size"])


PLAIN_TOKENIZER_KEYS = frozenset({"backend", "tokenizer_class", "bos_token", "eos_token", "pad_token", "unk_token",
                                  "model_max_length", "padding_side", "clean_up_tokenization_spaces"})
"""``tokenizer_config.json`` keys that do not change how a fast tokenizer encodes; a folder with any other key
(a chat template, ``add_prefix_space``, ...) is encoded by the Hugging Face tokenizer itself."""


def prompt_encoder(model_dir: Path) -> Callable[[str], list[int]]:
    """``modeling.encode_prompt`` with ``model_dir``'s tokenizer, as a function of the prompt's text.

    A folder whose fast tokenizer (``tokenizer.json``) has no chat template and only :data:`PLAIN_TOKENIZER_KEYS`
    is encoded as that rule says, ``[bos] + encode(text, add_special_tokens=False)``, with the ``tokenizers``
    library alone (what the Hugging Face fast tokenizer wraps), so the dataset role imports neither torch nor
    transformers. Any other folder goes through :mod:`dora_rl.modeling`. Invariant: the same ids either way
    (``tests/unit/test_prompt_encoder.py``).
    """
    model_dir = Path(model_dir)
    cfg_path, tok_path = model_dir / "tokenizer_config.json", model_dir / "tokenizer.json"
    cfg: dict[str, Any] = json.loads(cfg_path.read_text()) if cfg_path.exists() else {}
    templated = any((model_dir / f).exists() for f in ("chat_template.jinja", "chat_template.json"))
    if tok_path.exists() and cfg_path.exists() and not templated and set(cfg) <= PLAIN_TOKENIZER_KEYS:
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(tok_path))
        bos_name = cfg.get("bos_token")
        bos_name = bos_name.get("content") if isinstance(bos_name, dict) else bos_name
        bos = tok.token_to_id(bos_name) if bos_name else None
        if bos_name is None or bos is not None:
            head = [] if bos is None else [int(bos)]
            return lambda text: head + [int(i) for i in tok.encode(text, add_special_tokens=False).ids]
    from dora_rl import modeling

    hf_tok = modeling.load_tokenizer(model_dir)
    return lambda text: modeling.encode_prompt(hf_tok, text)
