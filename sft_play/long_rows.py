"""Memory levers for long rows, applied to the model the run trains and to the layer the planner
traces (:mod:`sft_play.planner.simulate.trace`), so that what is planned is what runs.

- :func:`tile_mlps`: each decoder layer's dense MLP computes its rows in tiles of about
  ``hidden_size`` tokens, in forward and again in backward, so that its intermediate activations
  (``[s, intermediate_size]``, 3-4 of them) exist for one tile at a time. DeepSpeed's
  ``TiledMLP`` (from Arctic Long Sequence Training) does the tiling; it runs single-process and
  under ZeRO, whose gradient reduction waits for the last tile (``ds_grad_is_ready``); DDP and
  FSDP2 reduce a weight's gradient at its first tile, so the config refuses them. Mixture-of-
  experts blocks are left whole (they reshape their input to rows and route per call).
- :class:`OffloadedHiddenStates`: the hidden states gradient checkpointing keeps from the
  forward pass until backward (each checkpointed layer's input, and the final norm's saved
  input) are kept in host memory instead, copied back when backward reaches them. torch's own
  ``save_on_cpu`` would move every saved tensor; these are the ones that grow with the layers x
  the sequence.
- :func:`attend_by_example`: where each row is split across processes (DeepSpeed Ulysses),
  attention gets no mask, and SDPA would then let the examples packed in a row attend to each
  other; with it, each example attends only to itself, found from the position ids Ulysses
  gathers (FlashAttention-2 reads them itself).
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable
from typing import Any

import torch


def tile_count(seq_len: int, hidden_size: int) -> int:
    """Tiles of about `hidden_size` tokens (ALST's choice: a tile's intermediate is then about the
    size of a weight matrix)."""
    return max(1, math.ceil(seq_len / max(1, hidden_size)))


def tile_mlps(layers: list[Any], hidden_size: int, per_tile: Callable[[Any, int], Any] | None = None) -> int:
    """Make each decoder layer's ``mlp`` compute in tiles along the sequence; returns how many
    were tiled. Patches the module instances (not their classes), so that another model in
    the process is untouched. `per_tile(fn, tiles)`, where given, wraps the function each tile
    calls (the planner's trace repeats a recorded tile instead of running it again)."""
    from sft_play import lean_imports

    lean_imports.needed("deepspeed")  # a process that skipped it may still plan or train tiles
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledMLP

    def forward_in_tiles(module: Any, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        plain = module._sft_play_untiled_forward
        if x.dim() < 2 or args or kwargs:
            return plain(x, *args, **kwargs)
        tiles = _agreed(tile_count(x.shape[-2], hidden_size), x.device)
        trained = [p for p in module.parameters() if p.requires_grad]  # a list: TiledMLP iterates it
        fn = lambda _, tile: plain(tile)  # noqa: E731
        return TiledMLP.apply(per_tile(fn, tiles) if per_tile else fn, module, x, tiles, trained)

    tiled = 0
    for layer in layers:
        mlp = getattr(layer, "mlp", None)
        if mlp is None or hasattr(mlp, "_sft_play_untiled_forward") or _routed(mlp):
            continue
        mlp._sft_play_untiled_forward = mlp.forward
        mlp.forward = forward_in_tiles.__get__(mlp)
        tiled += 1
    return tiled


def _routed(mlp: Any) -> bool:
    """A mixture-of-experts block (a router and experts), not a dense MLP."""
    return any(hasattr(mlp, name) for name in ("experts", "router", "gate")) and not hasattr(mlp, "gate_proj")


def _agreed(tiles: int, device: torch.device) -> int:
    """The most tiles any rank needs: under ZeRO-3 each tile gathers the parameters again, and
    ranks that made different numbers of gathers would wait for each other forever (DeepSpeed's
    TiledMLP example agrees the same way)."""
    import torch.distributed as dist

    if device.type == "meta" or not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return tiles  # (the planner's trace, on the meta device, runs in one process's head)
    count = torch.tensor(tiles, device=device)
    dist.all_reduce(count, op=dist.ReduceOp.MAX)
    return int(count.item())


class OffloadedHiddenStates(torch.autograd.graph.saved_tensors_hooks):
    """Within it, a tensor saved for backward that has the residual stream's shape ``[batch,
    seq, hidden_size]`` (what checkpointing keeps per layer) is kept in host memory and copied
    back to its device when backward unpacks it; other saved tensors stay where they are. A
    tensor saved twice (RMSNorm saves its fp32 upcast for two products) is copied once. On a CPU
    the copy is made all the same (it saves nothing there, and runs the path a GPU runs). The
    host copies are not pinned: torch's pinned-memory cache rounds each block up to a power of
    two, up to twice what the plan counts; the copies are synchronous instead, small beside a
    long row's compute."""

    def __init__(self, hidden_size: int) -> None:
        copies: dict[int, tuple[Any, torch.Tensor]] = {}  # id -> (a weak reference to the tensor, its copy)

        def pack(tensor: torch.Tensor) -> Any:
            if tensor.dim() != 3 or tensor.shape[-1] != hidden_size or isinstance(tensor, torch.nn.Parameter):
                return tensor
            known = copies.get(id(tensor))
            if known is not None and known[0]() is tensor:  # the same tensor saved again
                return (tensor.device, known[1])
            host = tensor.detach().to("cpu", copy=True)
            copies[id(tensor)] = (weakref.ref(tensor), host)
            return (tensor.device, host)

        def unpack(packed: Any) -> torch.Tensor:
            if isinstance(packed, tuple):
                device, host = packed
                return host.to(device)
            return packed

        super().__init__(pack, unpack)


def attend_by_example(sdpa: Any) -> Any:
    """transformers' SDPA attention function `sdpa`, made to run each example of a packed row on
    its own where no mask is given: a row whose position ids restart at 0 holds several examples,
    and each span from one restart to the next attends causally to itself only (the
    variable-length attention FlashAttention-2 does in one kernel, here as one SDPA call per
    example). With a mask, without position ids, or one example per row, `sdpa` itself.

    Kept rather than a block-diagonal mask: that is [tokens x tokens] per row, what a split
    sequence exists to avoid (Ulysses drops masks for that reason)."""

    def attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attention_mask: torch.Tensor | None, *args: Any, position_ids: torch.Tensor | None = None,
                  **kwargs: Any) -> tuple[torch.Tensor, None]:
        if attention_mask is not None or position_ids is None or position_ids.shape[-1] != query.shape[2]:
            return sdpa(module, query, key, value, attention_mask, *args, position_ids=position_ids, **kwargs)
        starts = [(row == 0).nonzero().flatten().tolist() for row in position_ids]
        if all(row == [0] for row in starts):
            return sdpa(module, query, key, value, attention_mask, *args, position_ids=position_ids, **kwargs)
        length = query.shape[2]
        rows = []
        for index, row in enumerate(starts):
            bounds = [0, *(start for start in row if start > 0), length]
            spans = [sdpa(module, query[index:index + 1, :, a:b], key[index:index + 1, :, a:b],
                          value[index:index + 1, :, a:b], None, *args, position_ids=position_ids[index:index + 1, a:b],
                          **kwargs)[0] for a, b in zip(bounds, bounds[1:])]
            rows.append(torch.cat(spans, dim=1))  # [1, tokens, heads, head_dim]
        return torch.cat(rows, dim=0), None

    attention.by_example = True
    return attention
