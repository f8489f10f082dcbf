"""What every metrale TensorRT plugin shares (the GEMMs in `trt_plugin`, the MoE and conv in
`trt_kernel_ops`, the collectives in `trt_collectives`): `Keeper`, which holds the Python plugin
objects TensorRT only borrows, `PluginDefaults`, the IPluginV3 methods they all answer alike, and
`act_of`, the cubin dtype of a TensorRT activation type. No TensorRT import here.
"""

from __future__ import annotations

# TensorRT DataType member name -> the activation dtype a cubin is compiled for (`plugins.aot`)
ACT_OF_TYPE = {"FLOAT": "fp32", "HALF": "fp16", "BF16": "bf16"}


def act_of(trt_type) -> str:
    """`fp32`/`fp16`/`bf16` for a TensorRT DataType (or its member name)."""
    name = getattr(trt_type, "name", str(trt_type))
    if name not in ACT_OF_TYPE:
        raise RuntimeError(f"TensorRT plugin: activation type {name} has no kernel; allowed: "
                           f"{', '.join(ACT_OF_TYPE)}")
    return ACT_OF_TYPE[name]


def init_plugin(plugin, trt, name: str) -> None:
    """Run the IPluginV3 interfaces' initialisers on `plugin` and give it the identity every
    metrale plugin has: its op's name, version "1", namespace "", one output."""
    for base in (trt.IPluginV3, trt.IPluginV3OneCore, trt.IPluginV3OneBuild, trt.IPluginV3OneRuntime):
        base.__init__(plugin)
    plugin.plugin_name, plugin.plugin_namespace, plugin.plugin_version = name, "", "1"
    plugin.num_outputs, plugin.timing_cache_id = 1, ""


class Keeper:
    """Python plugin objects TensorRT holds by borrowed pointers (a collected one would be a
    use-after-free): each is held from its creation until TensorRT calls its `destroy()`."""

    def __init__(self):
        self._held: dict[int, object] = {}

    def hold(self, obj):
        obj._keeper, obj._keep_key = self, id(obj)
        self._held[obj._keep_key] = obj
        return obj

    def release(self, obj) -> None:  # builtin-free: may run while the interpreter shuts down
        self._held.pop(obj.__dict__.get("_keep_key"), None)

    def __len__(self) -> int:
        return len(self._held)


class PluginDefaults:
    """The IPluginV3 methods every metrale plugin answers the same way (a plain mixin, listed
    before TensorRT's interfaces so its methods win): no extra capability objects, released by
    its `Keeper` when TensorRT destroys it, outputs typed like the first input, no workspace,
    no tactics, and one clone per execution context."""

    def get_capability_interface(self, _type):
        return self

    def destroy(self):  # TensorRT is done with this object: its keeper lets it go
        # no builtins here: TensorRT may call this while the interpreter shuts down
        keeper = self.__dict__.get("_keeper")
        if keeper is not None:
            keeper.release(self)

    def get_output_data_types(self, input_types):
        return [input_types[0]]

    def configure_plugin(self, inp, out):
        pass

    def get_workspace_size(self, inp, out):
        return 0

    def get_valid_tactics(self):
        return []

    def on_shape_change(self, inp, out):
        pass

    def set_tactic(self, tactic):
        pass

    def attach_to_context(self, context):
        return self.clone()
