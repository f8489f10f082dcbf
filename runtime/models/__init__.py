"""The models: the target (Qwen3/Qwen3-MoE), the MTP head, DFlash/DFlash2 drafters, their layers, quantized linears, configs, checkpoint loading and tensor-parallel cuts."""
