"""Loading checkpoints: safetensors files (safetensors_files) into a model's parameters (weights)."""
