"""Parameter-efficient fine-tuning: LoRA on the shardwise Transformer, adapters in peft's format."""

from shardwise.peft.lora import (
    AdapterSettings,
    LoRALinear,
    apply_lora,
    from_peft_state,
    hf_module_name,
    is_lora_name,
    load_adapter,
    lora_init,
    lora_parameter_names,
    lora_state_dict,
    merge_lora,
    read_adapter,
    read_adapter_config,
    reset_lora_parameters,
    save_adapter,
    to_peft_state,
)

__all__ = [
    "AdapterSettings",
    "LoRALinear",
    "apply_lora",
    "from_peft_state",
    "hf_module_name",
    "is_lora_name",
    "load_adapter",
    "lora_init",
    "lora_parameter_names",
    "lora_state_dict",
    "merge_lora",
    "read_adapter",
    "read_adapter_config",
    "reset_lora_parameters",
    "save_adapter",
    "to_peft_state",
]
