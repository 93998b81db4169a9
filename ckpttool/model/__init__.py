"""The model inside a checkpoint, found by structure: which entries are the model and which the
optimizer (model_view), --rename/--filter (keys), LoRA adapters (lora) and quantised weights
(quantization). Imports `core`, `store` and `formats` only."""
