"""pagedllm's benchmarks: one entry per question, each run from the repository root as
`.venv/bin/python -m benchmarks.<name> [--help]`. The figures they produced, with the machine
and the command for each, are in `benchmarks/results/README.md`.

Throughput and serving against other engines
    compare             How do pagedllm, vLLM (CPU), llama.cpp and Transformers compare on the
                        same model and prompts, offline and served at three request rates?
                        (The peers are installed and run by `benchmarks.peers`.)
    throughput_vs_hf    How much does continuous batching gain over Transformers' padded
                        `generate` on equal and on variable lengths?
    serve_vs_offline    What does the server (HTTP, SSE, two processes) cost against the
                        offline engine on one workload?
    api_cpu_pairs       How much CPU does the API process spend per streamed token, and what
                        do the served tokens/s reach, before and after a change?
    startup             How long from launching `pagedllm serve` until `/health` answers?
    embeddings          How many inputs and tokens per second does `/v1/embeddings` embed at
                        batch 1 and 64, against the offline `LLM.embed`?
    run_batch_overhead  What does `pagedllm run-batch` (OpenAI's batch format) cost against
                        `LLM.chat` on the same 1,000 requests?

The CPU step against the machine
    arithmetic_peak     What do the cores issue at most (FMA, VNNI, bf16 dot products), that no
                        matmul passes?
    ceiling             What is the fp32 matmul rate at the model's shapes, and what share of
                        it does an engine run reach?
    step_breakdown      Where does a prefill and a decode step's time go (schedule, forward,
                        logits, sampling), and what share of the ceiling is it?
    skinny_linear       At one to a few hundred rows, which matmul wins: the skinny kernel,
                        sgemm or oneDNN's prepacked weights?
    gguf_matmul         How fast is the gguf kernel on a layer's four matmuls beside fp32?
    bf16_matmul         Does a bf16 layer multiply faster on its bf16 packed weight or on an
                        fp32 copy, at how many rows?
    attention_kernel    How long does one layer's attention call take, per case and backend?
    decode_attention_floor  How close is decode attention to what memory allows?
    compiled_decode     How much does the compiled decode step save over the eager forward?
    single_stream       Is single-stream decode ahead of llama.cpp's F32 `tg128`, paired round
                        by round?

Quantization and real sizes
    int8_accuracy       How many of fp32's greedy tokens does each quantized variant keep?
    int8_speed          How fast are int8 matmuls per shape, and W1 with and without them?
    random_gguf         (A tool.) Writes a random-weight GGUF file of a real Llama shape
                        (1B, 8B) and llama.cpp file type (Q4_K_M, ...), so every engine can
                        run the same file without a download.
    real_size           At Llama-3.2-1B and -3.1-8B shapes on Q4_K_M blocks: load time and
                        memory, single-stream decode against llama.cpp and the bandwidth bound,
                        32 concurrent requests against llama.cpp's server.
    quantized_real_size Every quantized checkpoint format (GPTQ, AWQ, W4A16 g128; W8A8 int8,
                        FP8 dynamic and blocks; GGUF Q4_K_M; the dense model) on one random
                        Llama shape in one sitting: weights held against the checkpoint,
                        load, single-stream and 32-sequence decode, the bandwidth bound,
                        llama.cpp on the Q4_K_M file. (`random_gptq`, `random_w8a8`: the
                        tools writing those checkpoints.)

Features' costs and gains
    prefix_caching      What does prefix caching save on a shared prefix and cost without one?
    parallel_sampling   Is n = 4 (forked in the scheduler) cheaper than four separate requests
                        (a frontend fan-out), with and without prefix caching?
    sampler_cost        What share of a decode step does each kind of sampling take?
    detokenize          What does detokenization cost per output token through tokenizers'
                        DecodeStream against the window of `tokenizer.decode` calls, alone
                        and in the frontend's per-step work?
    structured_output   What does an enforced JSON schema cost, and how long do grammars take
                        to compile?
    kv_waste            How much of the KV cache is allocated but empty at peak?
    moe_vs_dense        Does a mixture of experts decode at the speed of its active
                        parameters, against dense models of equal active and equal total size?
    sliding_window_kv   How much KV does a long Gemma 3 request hold with the windowed layers'
                        blocks freed, against every layer whole, and how many fit at once?
    fair_share          Does a tenant that floods the server delay another tenant's first
                        token, under fcfs and under fair scheduling?
    lora                How much W1 throughput do 8 LoRA adapters round-robin keep against the
                        base model alone, what share of the time do their deltas take, and
                        what do requests without an adapter pay?
    lora_load           How long does loading an adapter into a running server take, what
                        does its first request pay, and how much memory does it add?
    lora_kernel         What do one decode step's LoRA deltas cost on the torch path and in
                        the CPU kernel?

Reliability
    soak                Does the server stay up, answer every request and hold its memory and
                        files over 30 minutes of mixed, partly hostile traffic?
    rate_sweep          Up to what Poisson rate does p99 TTFT stay under 2 s, with two tenants,
                        under fcfs and under fair scheduling?

Distributed execution
    parallel_memory     How much weight and KV-cache memory does the largest rank hold, for
                        Llama-3-8B and -70B shapes at tp and pp from 1 to 8? (Computed.)
    allreduce           How long does a decode step's all-reduce (64 x hidden, fp32) take
                        between two ranks, through gloo and through shared memory?
    broadcast_cost      What does sending one step's SchedulerOutput to the workers cost,
                        through the shared-memory ring and through pipes?
    parallel_throughput W1 at TP=1, TP=2 and DP=2 on this host: requests/s, and each rank's
                        weight and KV memory.

Shell entries (run by path, they call the modules above)
    cpu_perf.sh         The CPU targets in one run: the working tree against a base commit in
                        a worktree, beside vLLM and llama.cpp.
    w1_sitting.sh       W1 against vLLM in one sitting, beside the cores' peak and the matmul
                        rates (the current throughput figure).
    bf16_sitting.sh     bf16 against fp32, beside vLLM: the cores' rates, W1-lite and
                        Llama-3.2-1B's shape in one sitting (results/bf16.md).
    ab_pairs.sh         Did a change move W1 or single-stream decode? Before and after in
                        alternating pairs of processes (results/refactors.md).

`timing` holds the shared timer; `tenant_server` starts a server with two tenants' keys;
`child_runs` runs one case per child process (a layout, a model size).
"""
