"""The reference engine's forward passes, one module per family (torch): `transformer` is the common MoE
transformer (products with stored weights, KV cache, prefill/decode); `gemma4`, `gpt_oss` and `qwen35moe`
subclass it where their graphs differ. Which class runs a file is the architecture table's `Arch.model`
(engines.reference.archs, torch-free data: hyperparameters, tensors, presets). Architectures the engine does not
run yet (deepseek4) have a table entry with `unsupported` and no module here.
"""
