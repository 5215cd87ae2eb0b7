"""Flux.1 (FluxTransformer2DModel + FluxPipeline) and Flux.2 (Flux2Transformer2DModel + Flux2Pipeline): their
prompt encoders (prompts.py) and how latents, position ids, timestep and guidance reach the DiT (latents.py),
each as the family's diffusers pipeline does it. variants.py puts them in the table of families."""
