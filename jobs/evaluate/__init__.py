"""What a job measures besides its loss: the held-out eval loss and text samples from fixed prompts."""
