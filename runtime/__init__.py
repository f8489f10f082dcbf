"""metrale.runtime: models (Qwen3/Qwen3-MoE target, MTP head, DFlash drafters), the engine
directory contract, the torch and tensorrt backends, the speculative decode loop and the server.

The runtime never imports the builder or the CLI; it imports the plugins' reference ops.
"""

__version__ = "0.1.0"  # metrale's version, recorded in the engine directories it writes

