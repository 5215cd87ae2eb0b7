"""The OpenAI-compatible surface: its object shapes, its error envelope, and a fine-tuning request as a Ferry spec."""
