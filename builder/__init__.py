"""metrale.builder: Hugging Face checkpoints -> quantized weights (ModelOpt) -> ONNX graphs ->
TensorRT engines, written as one engine directory. Reuses the runtime's model definitions."""
