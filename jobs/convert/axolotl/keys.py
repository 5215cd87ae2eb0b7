"""Why an axolotl key is not converted: the reason listed beside each key Ferry has no place for.

A key found here or matched by a prefix gets its reason; any other key the converter did not read is listed with
`UNKNOWN`. A key set to an off value (``false``, ``0``, an empty list) asks for nothing and is not listed.
"""

from __future__ import annotations

_ATTENTION = "Ferry uses transformers' default attention implementation (sdpa)"
_PARALLEL = (
    "Ferry trains a job on one GPU, streaming weights from CPU memory (offload), or data-parallel over "
    "distributed.ranks; it has no sharding or model parallelism to configure"
)
_KERNELS = "Ferry runs the model's own PyTorch modules; no fused or custom kernels are swapped in"
_TRACKING = "Ferry tracks to Weights & Biases (tracking.wandb) or MLflow (tracking.mlflow) only"
_RESUME = "Ferry resumes a job from its own last checkpoint (POST /v1/jobs/<id>/resume)"
_TOKENS = "Ferry uses the tokenizer as saved; add tokens to it (and resize the model) before training"
_MULTIMODAL = "Ferry trains text-only causal LMs (AutoModelForCausalLM); no processor or vision/audio tower"
_CLOUD = "Ferry's service runs the job; there is no cloud launcher to configure"

REASONS = {
    "model_type": "Ferry reads the architecture from the model's config.json",
    "tokenizer_type": "Ferry loads the tokenizer with AutoTokenizer",
    "tokenizer_use_fast": "Ferry loads the tokenizer with AutoTokenizer",
    "tokenizer_legacy": "Ferry loads the tokenizer with AutoTokenizer",
    "tokenizer_use_mistral_common": "Ferry loads the tokenizer with AutoTokenizer, not mistral-common",
    "trust_remote_code": "Ferry never runs a model's own code (specs arrive over HTTP); built-in architectures only",
    "output_dir": "Ferry keeps a job's outputs in its own directory (jobs/<id>/output, or --output)",
    "dataset_prepared_path": "Ferry tokenizes as it reads and keeps no prepared copy",
    "skip_prepare_dataset": "Ferry tokenizes as it reads and keeps no prepared copy",
    "push_dataset_to_hub": "Ferry uploads nothing",
    "hub_model_id": "Ferry uploads nothing; download the checkpoint (GET /v1/jobs/<id>/checkpoints)",
    "attn_implementation": _ATTENTION,
    "flash_attention": _ATTENTION,
    "sdp_attention": _ATTENTION,
    "xformers_attention": _ATTENTION,
    "flex_attention": _ATTENTION,
    "flash_optimum": _ATTENTION,
    "tf32": "TF32 matmuls are PyTorch's choice on the GPU, not a spec setting",
    "logging_steps": "every step is an event (GET /v1/jobs/<id>/events)",
    "eval_sample_packing": "evaluation batches as training does",
    "special_tokens": _TOKENS,
    "tokens": _TOKENS,
    "eot_tokens": "Ferry ends a turn where the chat template does",
    "resize_token_embeddings_to_32x": _TOKENS,
    "resume_from_checkpoint": _RESUME,
    "auto_resume_from_checkpoints": _RESUME,
    "deepspeed": _PARALLEL,
    "fsdp": _PARALLEL,
    "fsdp_config": _PARALLEL,
    "fsdp_version": _PARALLEL,
    "ddp_find_unused_parameters": _PARALLEL,
    "evals_per_epoch": "Ferry evaluates every eval.every_steps steps; an epoch's steps depend on the data",
    "saves_per_epoch": "Ferry checkpoints every checkpoint.every_steps steps and at the end; an epoch's steps "
    "depend on the data, so only the final checkpoint is kept unless save_steps is set",
    "strict": "Ferry always refuses unknown keys",
    "lora_model_dir": "Ferry starts a LoRA from fresh adapters; resume a Ferry job instead",
    "wandb_entity": "tracking.wandb takes a project and a mode only",
    "wandb_watch": "tracking.wandb takes a project and a mode only",
    "wandb_name": "tracking.wandb takes a project and a mode only",
    "wandb_log_model": "tracking.wandb takes a project and a mode only",
    "wandb_run_id": "tracking.wandb takes a project and a mode only",
    "group_by_length": "padded batches are grouped by length already (data.packing: padded)",
    "pad_to_sequence_len": "Ferry pads a batch to its longest row",
    "remove_unused_columns": "Ferry reads only the fields its data format names",
    "gradient_checkpointing_kwargs": "Ferry checkpoints each decoder layer without reentrancy; nothing to choose",
    "activation_offloading": "Ferry moves activations to the CPU when offload.activations decides to (auto)",
    "plugins": _KERNELS,
    "use_kernels": _KERNELS,
    "cut_cross_entropy": "Ferry computes the loss over chunks of the sequence already (no full logits tensor)",
    "torch_compile": "set training.compile: true (each decoder layer compiled once, shared by all layers; with "
    "model offload it needs offload.granularity: block)",
    "torch_compile_mode": "training.compile uses torch.compile's default mode; there is none to choose",
    "processor_type": _MULTIMODAL,
    "freeze_mm_modules": _MULTIMODAL,
    "loss_watchdog_threshold": "Ferry stops a job whose loss is not finite; there is no threshold to set",
    "loss_watchdog_patience": "Ferry stops a job whose loss is not finite; there is no threshold to set",
    "max_packed_sequence_len": "Ferry packs rows up to data.seq_len",
    "sample_packing_eff_est": "Ferry packs rows up to data.seq_len",
    "total_num_tokens": "Ferry counts tokens as it reads",
    "save_safetensors": "Ferry always saves safetensors",
    "save_only_model": "Ferry's checkpoints hold what a resume needs",
    "save_strategy": "Ferry checkpoints every checkpoint.every_steps steps and at the end",
    "eval_strategy": "Ferry evaluates every eval.every_steps steps and at the end",
    "evaluation_strategy": "Ferry evaluates every eval.every_steps steps and at the end",
    "eval_batch_size": "Ferry evaluates with training.batch_size",
    "eval_table_size": "Ferry's text_samples section writes completions of fixed prompts",
    "eval_max_new_tokens": "Ferry's text_samples section writes completions of fixed prompts",
    "debug": "not a training setting",
    "local_rank": "not a training setting",
    "low_cpu_mem_usage": "Ferry streams weights from the checkpoint into pinned memory already",
    "device_map": "Ferry places the model itself (offload streams it from the CPU)",
    "hf_use_auth_token": "Ferry reads local paths only; it never contacts the Hub",
    "gptq": "Ferry quantizes with bitsandbytes (model.quantize: nf4 or int8); GPTQ checkpoints are not read",
    "shuffle_merged_datasets": "Ferry shuffles its mix by training.seed always",
    "dataset_exact_deduplication": "Ferry reads every record as given; deduplicate the files first",
    "chat_template_jinja": "read with chat_template: jinja only",
}
# A key that starts with one of these gets its reason (families of switches that share one answer).
PREFIXES = {
    "liger_": _KERNELS,
    "lora_mlp_kernel": _KERNELS,
    "lora_qkv_kernel": _KERNELS,
    "lora_o_kernel": _KERNELS,
    "flash_attn_": _KERNELS,
    "use_scattermoe": _KERNELS,
    "use_sonicmoe": _KERNELS,
    "fused_": _KERNELS,
    "gptq_": "Ferry quantizes with bitsandbytes (model.quantize: nf4 or int8); GPTQ checkpoints are not read",
    "fsdp_": _PARALLEL,
    "dp_": _PARALLEL,
    "tensor_parallel": _PARALLEL,
    "context_parallel": _PARALLEL,
    "expert_parallel": _PARALLEL,
    "swanlab": _TRACKING,
    "trackio_": _TRACKING,
    "use_tensorboard": _TRACKING,
    "use_otel": _TRACKING,
    "otel_": _TRACKING,
    "mlflow_": _TRACKING,
    "comet_": _TRACKING,
    "gpu": _CLOUD,
    "node_count": _CLOUD,
    "volumes": _CLOUD,
    "dockerfile_commands": _CLOUD,
    "provider": _CLOUD,
    "ray_": _CLOUD,
    "use_ray": _CLOUD,
    "secrets": _CLOUD,
}
UNKNOWN = "it is not a setting Ferry has (see the spec reference in the README for what a job can set)"


def reason_for(key: str) -> str:
    """Why ``key`` is not converted."""
    if key in REASONS:
        return REASONS[key]
    return next((why for prefix, why in PREFIXES.items() if key.startswith(prefix)), UNKNOWN)


def asks_for_nothing(value: object) -> bool:
    """Whether a value turns its setting off (nothing is lost by not converting it)."""
    return value is False or value == 0 or value in ([], {}) or value in ("false", "False")
