"""Build a tiny random-weight Llama and a tokenizer locally (no model hub).

2 layers, hidden 64, head_dim 32 (vLLM's CPU attention rejects 16), a
byte-level BPE tokenizer trained on a few sentences. Weights come from a fixed
seed, so every build is the same model.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

from real_scheduler import LLAMA_CONFIG

CORPUS = [
    "The quick brown fox jumps over the lazy dog. " * 3,
    "Hello world, this is a tiny model used to test vLLM on CPU.",
    "Once upon a time there was a scheduler that published its state.",
] * 50 + [" ".join(str(i) for i in range(200))]


def build_tiny_model(directory: Path) -> Path:
    if (directory / "model.safetensors").is_file():
        return directory
    directory.mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch/transformers deprecations, not ours
        import torch
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
        from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

        tokenizer = Tokenizer(models.BPE(unk_token=None))
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tokenizer.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=LLAMA_CONFIG["vocab_size"],
            special_tokens=["<s>", "</s>", "<unk>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        )
        tokenizer.train_from_iterator(CORPUS, trainer=trainer)
        fast = PreTrainedTokenizerFast(
            tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
        )
        fast.save_pretrained(str(directory))
        config = {k: v for k, v in LLAMA_CONFIG.items() if k not in ("architectures",)}
        config.update(bos_token_id=fast.bos_token_id, eos_token_id=fast.eos_token_id)
        config.pop("model_type")
        config.pop("torch_dtype")
        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(**config)).to(torch.float32)
        model.save_pretrained(str(directory), safe_serialization=True)
    saved = json.loads((directory / "config.json").read_text())
    assert saved["head_dim"] == 32
    return directory
