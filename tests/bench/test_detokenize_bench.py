"""benchmarks.detokenize runs both paths on the same workload and leaves the frontend as it
found it (it swaps the output processor's decoders for the window path)."""

from __future__ import annotations

from benchmarks.detokenize import run_detokenizers, run_output_processor, workload
from pagedllm.frontend import output_processor
from pagedllm.frontend.detokenizer import IncrementalDetokenizer
from pagedllm.frontend.token_decoder import token_text_decoder
from pagedllm.model.gguf_loader import load_gguf_tokenizer
from pagedllm.model.loader import default_model_path


def test_both_paths_give_the_same_text_and_outputs():
    tokenizer = load_gguf_tokenizer(default_model_path())
    pairs = workload(tokenizer, requests=4, tokens=16)
    assert len(pairs) == 4 and all(len(output) == 16 for _, output in pairs)
    window = run_detokenizers(tokenizer, pairs, False, ["never-there"])
    assert run_detokenizers(tokenizer, pairs, True, ["never-there"]) == window
    assert all(window)
    for flag in (False, True):
        # One output per request per step (delta outputs), logprobs or not.
        assert run_output_processor(tokenizer, pairs, flag, 0) == 4 * 16
        assert run_output_processor(tokenizer, pairs, flag, 5) == 4 * 16
    assert output_processor.IncrementalDetokenizer is IncrementalDetokenizer
    assert output_processor.token_text_decoder is token_text_decoder
