"""From a record to training tokens, by ``data.format``: text, instruction, chat (ShareGPT too) and preference pairs."""
