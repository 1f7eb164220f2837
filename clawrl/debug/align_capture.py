"""Per-layer hidden-state capture for `clawrl debug align`, by forward hooks on a CausalLM's modules.

Neither the engine nor the trainer knows it is being watched: hooks on the embedding, every decoder block
and the final norm record each module's output (the residual stream after the block) for the rows of the
current forward. Works on a plain model and on an FSDP2-wrapped one (fully_shard keeps the modules).

    capture = LayerCapture(model)     # hooks installed
    model(ids, positions, attn)
    capture.outputs                   # [K, N, H] fp32 on CPU, K = len(layer_names(num_layers))
    capture.close()                   # hooks removed

Shapes: K = captured modules (embed, layers 0..L-1, final norm), N = rows of the forward, H = hidden size.
"""

from __future__ import annotations

import torch
from torch import nn


def layer_names(num_layers: int) -> list[str]:
    """Names of the captured modules in forward order: "embed", "0" .. str(L - 1), "norm"."""
    return ["embed", *(str(i) for i in range(num_layers)), "norm"]


def describe_layer(name: str) -> str:
    """Human name for reports: "embed", "layer 3", "final norm"."""
    if name == "embed":
        return "embed"
    if name == "norm":
        return "final norm"
    return f"layer {name}"


class LayerCapture:
    """Records the outputs of a CausalLM's embedding, decoder blocks and final norm on every forward."""

    def __init__(self, model: nn.Module) -> None:
        modules = [model.model.embed_tokens, *model.model.layers, model.model.norm]
        self.names = layer_names(len(model.model.layers))
        self._latest: list[torch.Tensor | None] = [None] * len(modules)
        self._handles = [m.register_forward_hook(self._hook(k)) for k, m in enumerate(modules)]

    def _hook(self, k: int):
        def record(_module, _inputs, output):
            # Copied to fp32 on the host now: the engine's next step may reuse the device buffers.
            self._latest[k] = output.detach().float().cpu()

        return record

    @property
    def outputs(self) -> torch.Tensor:
        """[K, N, H] fp32: the last forward's output of each captured module."""
        missing = [self.names[k] for k, t in enumerate(self._latest) if t is None]
        if missing:
            raise RuntimeError(
                f"no hidden states were captured for {missing}: the forward did not run through the model's "
                "modules (fused kernels or a CUDA graph replay bypass the hooks)"
            )
        return torch.stack(self._latest)  # type: ignore[arg-type]

    def clear(self) -> None:
        """Forget the last forward's outputs (so a forward that bypasses the hooks is noticed)."""
        self._latest = [None] * len(self._latest)

    def close(self) -> None:
        """Remove the hooks."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
