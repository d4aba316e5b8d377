"""Multi-LoRA serving: adapters (PEFT format) applied on top of one base model, many in a
batch. `request` and `config` are shared leaves; `peft` reads and checks an adapter;
`layers` and `model_manager` apply the resident adapters inside the model runner."""
