"""Shapes and weights: the model config (the one source of truth for shapes), HF checkpoints, preparation."""
