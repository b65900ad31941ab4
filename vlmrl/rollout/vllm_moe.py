"""vLLM's Mixture-of-Experts layers, as the vLLM backend needs them beyond vLLM's own: the routing its worker
computes (`RoutingCaptureExtension`, mixed into the worker with the weight sync's extension), and the CPU MoE
kernel's experts repacked when a weight sync reloads them (`repack_cpu_experts_on_reload`). Both run inside vLLM's
worker and import vLLM only there (`vlmrl.rollout.vllm` is the backend that starts it).
"""

from __future__ import annotations

import functools

import torch


class RoutingCaptureExtension:
    """The MoE routing a vLLM engine computes (mixed into the worker with the weight-sync extension): each router's
    top-k ids as vLLM's own routed-experts capture takes them (`BaseRouter.capture_fn`, the logical ids before any
    expert-parallel mapping), appended per forward. vLLM's own capture (`enable_return_routed_experts`) needs its
    V2 model runner and Triton, so on a CPU this is the only way to see the engine's routing."""

    def vlmrl_capture_routing(self, on: bool) -> int:
        """Start (clearing what was kept) or stop capturing; returns the number of MoE layers bound."""
        from vllm.model_executor.layers.fused_moe.layer import MoERunner
        from vllm.model_executor.layers.fused_moe.router.base_router import BaseRouter

        self._vlmrl_routing = []
        bound = 0
        for module in self.get_model().modules():
            if isinstance(module, MoERunner) and isinstance(module.router, BaseRouter):
                module.router.set_capture_fn(functools.partial(self._vlmrl_capture, module.layer_id) if on else None)
                bound += 1
        return bound

    def _vlmrl_capture(self, layer_id: int, topk_ids: torch.Tensor) -> None:
        self._vlmrl_routing.append((layer_id, topk_ids.detach().to("cpu", torch.int16).clone()))

    def vlmrl_take_routing(self) -> bytes:
        """What was captured since the last call, as safetensors bytes of one (MoE layers, tokens, k) int16 tensor:
        every forward's tokens in the order the engine ran them."""
        from safetensors.torch import save

        per_layer: dict[int, list[torch.Tensor]] = {}
        for layer_id, ids in self._vlmrl_routing:
            per_layer.setdefault(layer_id, []).append(ids)
        self._vlmrl_routing = []
        if not per_layer:
            return save({"routing": torch.zeros((0, 0, 0), dtype=torch.int16)})
        return save({"routing": torch.stack([torch.cat(per_layer[layer]) for layer in sorted(per_layer)])})



def repack_cpu_experts_on_reload(model: torch.nn.Module) -> None:
    """Make a reload of routed experts on vLLM's CPU MoE kernel put them in that kernel's layout.

    vLLM 0.32 lays a MoE layer's weights out for its CPU grouped GEMM when it first loads them (the experts'
    `process_weights_after_loading`: the intermediate size padded to the kernel's block, the tensors prepacked), and
    on a reload skips that step (`UnquantizedFusedMoEMethod._setup_kernel` runs it only while the kernel does not
    exist yet), then copies the plain tensors into the kernel's storage: a size mismatch where the intermediate size
    is padded (the embedded MoE models), and tensors read in the wrong packing where it is not (the same shape, no
    error, wrong outputs). Each such layer's method gets the step back on a reload (once per process; a no-op on
    CUDA, whose kernels take the plain layout)."""
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        kernel = getattr(method, "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if experts is None or "cpu" not in type(experts).__module__ or getattr(method, "_vlmrl_repacks", False):
            continue
        setup = method._setup_kernel

        def setup_and_repack(layer, w13, w2, setup=setup, method=method):
            setup(layer=layer, w13=w13, w2=w2)
            method.moe_kernel.fused_experts.process_weights_after_loading(layer)

        method._setup_kernel = setup_and_repack
        method._vlmrl_repacks = True
