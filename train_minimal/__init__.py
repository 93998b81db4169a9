"""train_minimal: a small GPT (or, with --arch llama, a model in transformers'
LlamaForCausalLM layout) trained with FSDP (FSDP2 or FSDP1) that writes sharded
torch.distributed.checkpoint checkpoints and resumes from them, at any world size.

Run it with `python -m train_minimal --help`; see the train_minimal section of README.md.
"""
