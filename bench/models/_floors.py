"""The floors of the real-model suites: each layout done by hand on ``bench/_floor.Floor``.

A floor runs the same model, batch and collectives as its layout, every parameter and the
batch in the minimal ``__torch_dispatch__`` subclass and every collective a plain
``torch.distributed`` call on the locals: what a Python tensor subclass pays for the layout,
with no layout logic. Each builder checks once, before it returns the step, that a forward
and backward give the loss and gradients of the unsplit model in one process.

- ``dp_floor``: a replica per rank, batch split on dim 0; after backward one flat
  all_reduce of every gradient, averaged.
- ``tp_floor``: the Megatron split of Llama (torchtitan's plan) on plain local shards:
  q/k/v/gate/up keep this rank's rows (output features), o/down its columns (input
  features); the attention keeps ``head_dim`` and reads the number of heads from the local
  shapes, so the rank computes its half of the heads (and of the key/value heads, GQA
  groups intact). Each attention and MLP block takes its input through ``_CopyToShards``
  (identity forward, one all_reduce of the input's gradient in backward) and returns its
  output through ``_SumOverShards`` (one all_reduce forward, identity backward): per decoder
  layer two all_reduces forward and two backward. Norms, embedding and head are replicated; the batch is
  the same on both ranks.
- ``fsdp_floor``: each decoder layer and then the root keep their parameters as one flat
  shard per rank (padded to a multiple of the world size). A forward pre-hook all_gathers
  the flat parameter (``_Gathered``: its backward reduce_scatters the flat gradient,
  averaged, into the shard's) and views each parameter out of it. As torch's
  ``fully_shard``, a layer frees the gathered storage after its forward and gathers it
  again when the gradient reaches its output; the root keeps it until its backward. Every
  unit frees it after its reduce_scatter. AdamW steps on the flat shards (one tensor per
  unit, where torch's and sbpflow's ``fully_shard`` keep one shard per parameter).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from bench._floor import Floor, floor_model

COLUMN_WISE = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
ROW_WISE = ("o_proj", "down_proj")


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local if isinstance(t, Floor) else t


def _all_reduced(t: torch.Tensor) -> Floor:
    """A new ``Floor`` holding the sum of ``t`` over the ranks."""
    local = _local(t).clone(memory_format=torch.contiguous_format)
    dist.all_reduce(local)
    return Floor.wrap(local)


def _floor_step(
    model: nn.Module,
    ids: Floor,
    params: list[nn.Parameter],
    sync: Callable[[], None] | None,
    foreach: bool | None,
) -> Callable[[], None]:
    optimizer = torch.optim.AdamW(params, lr=1e-4, foreach=foreach)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        model(input_ids=ids, labels=ids).loss.backward()
        if sync is not None:
            sync()
        optimizer.step()

    return step


def _reference(base: nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The unsplit model's loss and gradients on ``ids``, in this process."""
    model = copy.deepcopy(base)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def _check(what: str, got: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(
        got, expected, rtol=1e-4, atol=1e-5, msg=lambda m: f"{what} differs from one process: {m}"
    )


# -- data parallel -------------------------------------------------------------------------


def dp_floor(
    base: nn.Module, world_ids: torch.Tensor, rank: int, foreach: bool | None = None
) -> Callable[[], None]:
    world = dist.get_world_size()
    model = floor_model(base)
    names = [n for n, _ in model.named_parameters()]
    params = list(model.parameters())
    ids = Floor.wrap(world_ids.chunk(world)[rank].contiguous())

    def sync() -> None:
        grads = [p.grad._local for p in params if p.grad is not None]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat)
        flat /= world
        pieces = flat.split([g.numel() for g in grads])
        torch._foreach_copy_(grads, [c.view_as(g) for c, g in zip(pieces, grads, strict=True)])

    loss, grads = _reference(base, world_ids)
    mean_loss = _all_reduced(model(input_ids=ids, labels=ids).loss)._local / world
    _check("the DP floor's loss", mean_loss, loss)
    model.zero_grad(set_to_none=True)
    model(input_ids=ids, labels=ids).loss.backward()
    sync()
    for name, p in zip(names, params, strict=True):
        _check(f"the DP floor's gradient of {name}", p.grad._local, grads[name])
    return _floor_step(model, ids, params, sync, foreach)


# -- tensor parallel -----------------------------------------------------------------------


class _CopyToShards(torch.autograd.Function):
    """The input of a column-parallel block: identity forward, all_reduce backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return _all_reduced(grad)


class _SumOverShards(torch.autograd.Function):
    """The output of a row-parallel block: all_reduce forward, identity backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return _all_reduced(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad


def _shard_dim(name: str) -> int | None:
    """Which dim of the parameter ``name`` Megatron splits (None: replicated)."""
    module = name.split(".")[-2] if "." in name else ""
    return 0 if module in COLUMN_WISE else 1 if module in ROW_WISE else None


def _copy_in_kwargs(module: nn.Module, args: Any, kwargs: Any) -> tuple[Any, Any]:
    return args, {**kwargs, "hidden_states": _CopyToShards.apply(kwargs["hidden_states"])}


def _copy_in(module: nn.Module, args: Any) -> Any:
    return (_CopyToShards.apply(args[0]), *args[1:])


def _sum_out(module: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
    return _SumOverShards.apply(output)


def tp_floor(
    base: nn.Module, ids_plain: torch.Tensor, rank: int, foreach: bool | None = None
) -> Callable[[], None]:
    """Llama split by hand as torchtitan's plan splits it, on ``Floor`` parameters."""
    world = dist.get_world_size()
    local = copy.deepcopy(base)
    for name, p in local.named_parameters():
        dim = _shard_dim(name)
        if dim is not None:
            p.data = p.data.chunk(world, dim)[rank].clone()
    for layer in local.model.layers:
        for proj in (*COLUMN_WISE, *ROW_WISE):
            linear = getattr(layer.self_attn, proj, None) or getattr(layer.mlp, proj)
            assert linear.bias is None, "a row-parallel bias would be added on every rank"
    model = floor_model(local)
    for layer in model.model.layers:
        layer.self_attn.register_forward_pre_hook(_copy_in_kwargs, with_kwargs=True)
        layer.mlp.register_forward_pre_hook(_copy_in)
        layer.self_attn.o_proj.register_forward_hook(_sum_out)
        layer.mlp.down_proj.register_forward_hook(_sum_out)
    names = [n for n, _ in model.named_parameters()]
    params = list(model.parameters())
    ids = Floor.wrap(ids_plain)

    loss, grads = _reference(base, ids_plain)
    _check("the TP floor's loss", model(input_ids=ids, labels=ids).loss._local, loss)
    model.zero_grad(set_to_none=True)
    model(input_ids=ids, labels=ids).loss.backward()
    for name, p in zip(names, params, strict=True):
        dim, expected = _shard_dim(name), grads[name]
        expected = expected if dim is None else expected.chunk(world, dim)[rank]
        _check(f"the TP floor's gradient of {name}", p.grad._local, expected)
    return _floor_step(model, ids, params, None, foreach)


# -- fully sharded -------------------------------------------------------------------------


class _Gathered(torch.autograd.Function):
    """A unit's flat shard -> its gathered flat parameter; backward reduce_scatters."""

    @staticmethod
    def forward(ctx: Any, shard: torch.Tensor, unit: _Unit) -> torch.Tensor:
        ctx.unit = unit
        return Floor.wrap(unit.full)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        unit = ctx.unit
        out = torch.empty_like(_local(unit.shard))
        dist.reduce_scatter_tensor(out, _local(grad).contiguous())
        out /= unit.world
        unit.free()
        return Floor.wrap(out), None


class _Unit:
    """One fully sharded module: its parameters as one flat shard, gathered per use."""

    def __init__(self, module: nn.Module, names: list[str], reshard: bool) -> None:
        self.world, rank = dist.get_world_size(), dist.get_rank()
        self.reshard = reshard
        self.owners = []
        tensors = []
        for name in names:
            owner = module.get_submodule(name.rpartition(".")[0])
            attr = name.rpartition(".")[2]
            tensors.append(owner._parameters.pop(attr).detach())
            self.owners.append((owner, attr))
        self.shapes = [t.shape for t in tensors]
        self.numels = [t.numel() for t in tensors]
        total = sum(self.numels)
        padded = -(-total // self.world) * self.world
        flat = torch.zeros(padded, dtype=tensors[0].dtype)
        torch.cat([t.reshape(-1) for t in tensors], out=flat[:total])
        self.pad = padded - total
        self.shard = nn.Parameter(Floor.wrap(flat.chunk(self.world)[rank].clone()))
        self.full = torch.empty(padded, dtype=flat.dtype)
        self.nbytes = self.full.untyped_storage().nbytes()
        self.free()
        module.register_parameter("flat_shard", self.shard)
        module.register_forward_pre_hook(self.pre_forward)
        module.register_forward_hook(self.post_forward)

    def free(self) -> None:
        self.full.untyped_storage().resize_(0)
        self.gathered = False

    def gather(self) -> None:
        if not self.gathered:
            self.full.untyped_storage().resize_(self.nbytes)
            dist.all_gather_into_tensor(self.full, self.shard._local)
            self.gathered = True

    def pre_forward(self, module: nn.Module, args: Any) -> None:
        self.gather()
        pieces = _Gathered.apply(self.shard, self).split([*self.numels, self.pad])
        for (owner, attr), piece, shape in zip(self.owners, pieces, self.shapes, strict=False):
            setattr(owner, attr, piece.view(shape))

    def post_forward(self, module: nn.Module, args: Any, output: torch.Tensor) -> None:
        if self.reshard:
            self.free()
            output.register_hook(self.pre_backward)

    def pre_backward(self, grad: torch.Tensor) -> None:
        self.gather()


def fsdp_floor(
    base: nn.Module, world_ids: torch.Tensor, rank: int, foreach: bool | None = None
) -> Callable[[], None]:
    """Each decoder layer, then the root, fully sharded by hand on ``Floor`` flat shards."""
    world = dist.get_world_size()
    model = floor_model(base)
    units = []
    for i, layer in enumerate(model.model.layers):
        names = [n for n, _ in layer.named_parameters()]
        units.append((f"model.layers.{i}.", names, _Unit(layer, names, reshard=True)))
    root_names = [n for n, _ in model.named_parameters() if not n.startswith("model.layers.")]
    units.append(("", root_names, _Unit(model, root_names, reshard=False)))
    params = list(model.parameters())
    assert len(params) == len(units), "every parameter belongs to one unit's flat shard"
    ids = Floor.wrap(world_ids.chunk(world)[rank].contiguous())

    loss, grads = _reference(base, world_ids)
    mean_loss = _all_reduced(model(input_ids=ids, labels=ids).loss)._local / world
    _check("the FSDP floor's loss", mean_loss, loss)
    for _, _, unit in units:
        unit.free()  # that forward had no backward
    model.zero_grad(set_to_none=True)
    model(input_ids=ids, labels=ids).loss.backward()
    for prefix, names, unit in units:
        flat = torch.cat([grads[prefix + n].reshape(-1) for n in names])
        flat = torch.nn.functional.pad(flat, (0, unit.pad))
        what = f"the FSDP floor's gradient of {prefix or 'the root'}"
        _check(what, unit.shard.grad._local, flat.chunk(world)[rank])
        assert not unit.gathered, "every unit frees its gathered parameter after its backward"
    return _floor_step(model, ids, params, None, foreach)
