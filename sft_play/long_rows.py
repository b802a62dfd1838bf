"""Memory levers for long rows, applied to the model the run trains and to the layer the planner
traces (:mod:`sft_play.planner.simulate.trace`), so that what is planned is what runs.

- :func:`tile_mlps`: each decoder layer's MLP computes its rows in tiles of about ``hidden_size``
  tokens, in forward and again in backward, so that its intermediate activations (``[s,
  intermediate_size]``, 3-4 of them) exist for one tile at a time. DeepSpeed's ``TiledMLP``
  (from Arctic Long Sequence Training) does the tiling; it runs single-process and under ZeRO,
  whose gradient reduction waits for the last tile (``ds_grad_is_ready``); DDP and FSDP2
  reduce a weight's gradient at its first tile, so the config refuses them.
- :class:`OffloadedHiddenStates`: the hidden states gradient checkpointing keeps from the
  forward pass until backward (each checkpointed layer's input, and the final norm's) are kept in
  host memory instead, copied back when backward reaches them. torch's own ``save_on_cpu``
  would move every saved tensor; these are the ones that grow with the layers x the sequence.
"""

from __future__ import annotations

import math
from typing import Any

import torch


def tile_count(seq_len: int, hidden_size: int) -> int:
    """Tiles of about `hidden_size` tokens (ALST's choice: a tile's intermediate is then about the
    size of a weight matrix)."""
    return max(1, math.ceil(seq_len / max(1, hidden_size)))


def tile_mlps(layers: list[Any], hidden_size: int) -> int:
    """Make each decoder layer's ``mlp`` compute in tiles along the sequence; returns how many
    were tiled. Patches the module instances (not their classes), so that another model in
    the process is untouched."""
    from sft_play import lean_imports

    lean_imports.needed("deepspeed")  # a process that skipped it may still plan or train tiles
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledMLP

    def forward_in_tiles(module: Any, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        plain = module._sft_play_untiled_forward
        if x.dim() < 2 or args or kwargs:
            return plain(x, *args, **kwargs)
        tiles = tile_count(x.shape[-2], hidden_size)
        if tiles == 1:
            return plain(x)
        trained = [p for p in module.parameters() if p.requires_grad]  # a list: TiledMLP iterates it
        return TiledMLP.apply(lambda _, tile: plain(tile), module, x, tiles, trained)

    tiled = 0
    for layer in layers:
        mlp = getattr(layer, "mlp", None) or getattr(layer, "block_sparse_moe", None)
        if mlp is None or hasattr(mlp, "_sft_play_untiled_forward"):
            continue
        mlp._sft_play_untiled_forward = mlp.forward
        mlp.forward = forward_in_tiles.__get__(mlp)
        tiled += 1
    return tiled


class OffloadedHiddenStates(torch.autograd.graph.saved_tensors_hooks):
    """Within it, a tensor saved for backward that has the residual stream's shape ``[batch,
    seq, hidden_size]`` (what checkpointing keeps per layer) is kept in host memory, pinned where
    there is CUDA, and copied back to its device when backward unpacks it; other saved tensors
    stay where they are. On a CPU the copy is made all the same (it saves nothing there, and
    runs the path a GPU runs)."""

    def __init__(self, hidden_size: int) -> None:
        pin = torch.cuda.is_available()

        def pack(tensor: torch.Tensor) -> Any:
            if tensor.dim() != 3 or tensor.shape[-1] != hidden_size:
                return tensor
            host = torch.empty(tensor.size(), dtype=tensor.dtype, layout=tensor.layout, pin_memory=pin)
            host.copy_(tensor, non_blocking=pin)
            return (tensor.device, host)

        def unpack(packed: Any) -> torch.Tensor:
            if isinstance(packed, tuple):
                device, host = packed
                return host.to(device, non_blocking=pin)
            return packed

        super().__init__(pack, unpack)
