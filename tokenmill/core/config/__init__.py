"""Configuration: the engine's validated config tree (engine_config) and what a checkpoint's
config.json says about the model (model_config)."""
