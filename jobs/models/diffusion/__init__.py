"""``model.kind: diffusers_transformer``: Qwen-Image and Wan DiTs trained with flow matching."""
