"""Tiny random Flux.1 and Flux.2 pipelines saved to a directory, for the diffusion tests.

The real classes with tiny configs (FluxPipeline: CLIP-L pooled + T5, AutoencoderKL; Flux2Pipeline: Mistral3
with a chat template, AutoencoderKLFlux2); the tokenizers are the byte-level one of pipelines.py, so nothing
is downloaded. The Mistral text encoder has 30 layers (16 wide) because the pipeline stacks hidden states 10,
20 and 30.
"""

from __future__ import annotations

from pathlib import Path

import torch

from tests.jobs.models.diffusion.pipelines import byte_tokenizer

FLUX1_TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out",
                 "ff.net.2", "ff_context.net.2", "proj_mlp"]  # fmt: skip
FLUX2_TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out", "ff.linear_in",
                 "ff.linear_out", "ff_context.linear_in", "ff_context.linear_out", "to_qkv_mlp_proj"]  # fmt: skip
# A Mistral-style chat template over content lists, as Flux2Pipeline's format_input builds the messages.
CHAT_TEMPLATE = (
    "{% for message in messages %}{% for part in message['content'] %}"
    "[{{ message['role'] }}]{{ part['text'] }}{% endfor %}{% endfor %}"
)


def flux1_pipeline(directory: Path, *, guidance_embeds: bool = True, attention_head_dim: int = 16) -> Path:
    """A FluxPipeline (Flux.1-dev's layout: CLIP + T5, guidance embedding) of tiny parts, saved to ``directory``."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    torch.manual_seed(0)
    tokenizer, tokenizer_2 = byte_tokenizer(), byte_tokenizer()
    tokenizer.model_max_length = 77
    vocab = len(tokenizer) + 8
    clip = CLIPTextModel(
        CLIPTextConfig(
            vocab_size=vocab,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            projection_dim=16,
            max_position_embeddings=77,
            eos_token_id=vocab - 1,
        )
    )
    t5 = T5EncoderModel(T5Config(vocab_size=vocab, d_model=32, d_kv=8, d_ff=32, num_layers=2, num_heads=4))
    transformer = FluxTransformer2DModel(
        patch_size=1,
        in_channels=16,
        num_layers=1,
        num_single_layers=2,
        attention_head_dim=attention_head_dim,
        num_attention_heads=2,
        joint_attention_dim=32,
        pooled_projection_dim=16,
        guidance_embeds=guidance_embeds,
        axes_dims_rope=(attention_head_dim // 4, attention_head_dim * 3 // 8, attention_head_dim * 3 // 8),
    )
    vae = AutoencoderKL(
        block_out_channels=(8, 16),
        down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
        up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"),
        latent_channels=4,
        norm_num_groups=4,
        layers_per_block=1,
        shift_factor=0.06,
        scaling_factor=0.9,
        use_quant_conv=False,
        use_post_quant_conv=False,
    )
    scheduler = FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True, shift=3.0)
    pipe = FluxPipeline(
        scheduler=scheduler,
        vae=vae,
        text_encoder=clip,
        tokenizer=tokenizer,
        text_encoder_2=t5,
        tokenizer_2=tokenizer_2,
        transformer=transformer,
    )
    pipe.save_pretrained(str(directory))
    return directory


def flux2_pipeline(directory: Path, *, attention_head_dim: int = 16) -> Path:
    """A Flux2Pipeline (Mistral3 text encoder, AutoencoderKLFlux2) of tiny parts, saved to ``directory``."""
    from diffusers import AutoencoderKLFlux2, FlowMatchEulerDiscreteScheduler, Flux2Pipeline, Flux2Transformer2DModel
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration

    torch.manual_seed(0)
    tokenizer = byte_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    vocab = len(tokenizer) + 8
    config = Mistral3Config(
        text_config={
            "model_type": "mistral",
            "vocab_size": vocab,
            "hidden_size": 16,
            "intermediate_size": 16,
            "num_hidden_layers": 30,
            "num_attention_heads": 2,
            "num_key_value_heads": 2,
            "head_dim": 8,
            "max_position_embeddings": 512,
        },
        vision_config={
            "model_type": "pixtral",
            "hidden_size": 16,
            "intermediate_size": 16,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "head_dim": 8,
            "image_size": 32,
            "patch_size": 8,
        },
        image_token_index=vocab - 1,
    )
    text_encoder = Mistral3ForConditionalGeneration(config)
    transformer = Flux2Transformer2DModel(
        patch_size=1,
        in_channels=16,
        num_layers=1,
        num_single_layers=2,
        attention_head_dim=attention_head_dim,
        num_attention_heads=2,
        joint_attention_dim=48,  # 3 stacked hidden states of 16
        timestep_guidance_channels=32,
        axes_dims_rope=(attention_head_dim // 4,) * 4,
    )
    vae = AutoencoderKLFlux2(
        block_out_channels=(8, 16),
        down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
        up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"),
        latent_channels=4,
        norm_num_groups=4,
        layers_per_block=1,
    )
    with torch.no_grad():  # running statistics a trained VAE would have, so normalizing is not the identity
        vae.bn.running_mean.uniform_(-0.2, 0.2)
        vae.bn.running_var.uniform_(0.5, 1.5)
    scheduler = FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True, shift=3.0)
    pipe = Flux2Pipeline(
        scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, transformer=transformer
    )
    pipe.save_pretrained(str(directory))
    return directory
