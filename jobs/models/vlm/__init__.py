"""``model.kind: hf_image_text_to_text``: vision-language models (Qwen2.5-VL, Idefics3, SmolVLM, LLaVA, Gemma 3)
fine-tuned on chat rows with images (``data.kind: image_chat``). The registry entry is family.py."""
