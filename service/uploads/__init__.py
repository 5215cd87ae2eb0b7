"""Uploaded files: streamed to the uploads directory with their SHA-256, and a fine-tuning file's rows checked."""
