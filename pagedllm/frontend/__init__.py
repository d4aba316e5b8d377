"""The API process's engine front: requests built and checked (processor, admission, chat
templates), outputs detokenized and gathered, LLMEngine and AsyncLLM over an engine client."""
