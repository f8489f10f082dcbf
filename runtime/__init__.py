"""metrale.runtime: models (Qwen3/Qwen3-MoE target, MTP head, DFlash drafters), the engine
directory contract, the torch and tensorrt backends, the speculative decode loop and the server.

The runtime never imports the builder; it imports the plugins' reference ops.
"""
