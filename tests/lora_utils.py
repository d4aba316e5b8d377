"""PEFT adapters for tests: random, non-zero LoRA A and B on a tiny base model, and the
Transformers + PEFT greedy reference on the merged model."""

from __future__ import annotations

from pathlib import Path

import torch

ALL_PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_peft_adapter(
    base_dir: Path,
    out_dir: Path,
    seed: int,
    rank: int = 8,
    alpha: float = 16.0,
    target_modules: list[str] | None = None,
    use_rslora: bool = False,
    safe_serialization: bool = True,
    std: float = 0.05,
) -> Path:
    """Save a PEFT LoRA adapter of `base_dir` with seeded random A and B to `out_dir`."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    config = LoraConfig(
        r=rank,
        lora_alpha=alpha,
        target_modules=target_modules or ALL_PROJECTIONS,
        use_rslora=use_rslora,
        lora_dropout=0.0,
        init_lora_weights=False,
    )
    peft_model = get_peft_model(model, config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * std)
    peft_model.save_pretrained(out_dir, safe_serialization=safe_serialization)
    return out_dir


def merged_model(base_dir: Path, adapter_dir: Path | None):
    """Transformers' model with the adapter merged in (the base model for None)."""
    model = peft_model(base_dir, adapter_dir)
    return model if adapter_dir is None else model.merge_and_unload().eval()


def peft_model(base_dir: Path, adapter_dir: Path | None):
    """Transformers' model with the adapter beside its base layers, not merged: each
    projection is base_layer(x) + B A x (the base model for None)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    if adapter_dir is None:
        return model.eval()
    from peft import PeftModel

    return PeftModel.from_pretrained(model, adapter_dir).eval()
