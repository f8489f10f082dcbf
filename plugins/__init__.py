"""metrale.plugins: custom ops, one module per op, each with a PyTorch reference (the oracle), a
Triton kernel, an ONNX node in the `metrale` domain and a TensorRT plugin; `aot` compiles the
kernels to cubins per SM. Imports neither triton nor TensorRT until a face that needs it is used."""
