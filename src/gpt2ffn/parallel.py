"""Tensor parallelism (Megatron-LM, Shoeybi et al. 2019, section 3) over a torch.distributed device mesh,
with PyTorch's DTensor: a plan applied to an unchanged GPT2 or FeedForward, as torchtitan does.

What each of N ranks holds (docs/tp.png):
- FFN: c_fc's [in, out] weight and its bias sharded on the output dim (Shard(1), Shard(0)): each rank
  computes hidden units 4d/N of its own and applies GELU to them with no communication; c_proj's weight
  sharded on the input dim (Shard(0)), so each rank's product is a partial sum of the output; ONE
  all-reduce (Partial -> Replicate) adds them; c_proj's bias is replicated and added once, after it.
- attention: split by heads. c_attn's [d, 3d] weight, viewed as [d, 3, d] (q | k | v), sharded on the head
  dim (Shard(2)): rank r holds q, k and v of heads rH/N..(r+1)H/N; its KV cache holds those heads only
  (`model.kv_config`); attn.c_proj is sharded by rows like c_proj of the FFN, one all-reduce.
- the tied wte / lm_head: vocab-parallel (wte RowwiseParallel: each rank looks up its rows of the vocabulary,
  one all-reduce; lm_head ColwiseParallel: each rank computes its vocabulary slice of the logits, one
  all-gather) or replicated (every rank the whole matrix, no communication); benchmarks/tp.py measures both.
- LayerNorms and wpe: replicated.

Why Conv1D takes explicit placements: parallelize_module's ColwiseParallel / RowwiseParallel shard
nn.Linear's [out, in] weight (Shard(0) / Shard(1)) and refuse any other module; GPT-2's Conv1D stores
[in, out], so its output dim is 1 and its input dim 0, and c_attn's heads are not a contiguous slice of its
columns at all. Those layers get distribute_tensor with the placements above; the styles fit wte
(nn.Embedding) and lm_head (nn.Linear) as they are, and are used there.

The sharded modules compute on their local shards with the same kernels as one process (kernels.ffn, its
RecomputeGELU backward included); the communication is DTensor's: `from_local(..., [Partial()])
.redistribute([Replicate()])` is the all-reduce (Megatron's g; identity in backward), and
`to_local(grad_placements=[Partial()])` of the replicated input makes the backward all-reduce the input
gradient (Megatron's f; identity forward). So forward and gradients equal one process's (tests/test_parallel.py).
Training with dropout: seed every rank alike (torch.manual_seed), so the replicated outputs get the same masks.
"""

import dataclasses

import torch
import torch.distributed as dist
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from . import kernels
from .config import Config
from .errors import Gpt2ffnError
from .ffn import FeedForward
from .model import GPT2, CausalSelfAttention


def backend() -> str:
    """nccl where CUDA is present, gloo on CPU."""
    return "nccl" if torch.cuda.is_available() else "gloo"


def check_world(cfg: Config, world: int, attention: bool = True):
    """Refuse a world size that does not divide the FFN's hidden width (and n_head, for a whole model).
    Called before any collective, on every rank alike, so every rank raises and none waits for the others."""
    if world < 1:
        raise Gpt2ffnError(f"tensor-parallel world size must be >= 1, got {world}")
    if cfg.hidden % world:
        raise Gpt2ffnError(f"tensor-parallel world size {world} does not divide the FFN's hidden width "
                           f"{cfg.hidden} (n_inner or 4 * n_embd): each rank needs hidden / {world} units")
    if attention and cfg.n_head % world:
        raise Gpt2ffnError(f"tensor-parallel world size {world} does not divide n_head={cfg.n_head}: each rank "
                           f"needs whole heads (n_head / world)")


def make_mesh(world: int | None = None) -> DeviceMesh:
    """A 1-D mesh over the default process group (torchrun's, or init_process_group's)."""
    if not dist.is_initialized():
        raise Gpt2ffnError("tensor parallelism needs torch.distributed: launch with torchrun --nproc-per-node N "
                           "(or call torch.distributed.init_process_group first)")
    world = world or dist.get_world_size()
    return init_device_mesh("cuda" if torch.cuda.is_available() else "cpu", (world,))


def enter(x, mesh):
    """Megatron's f: x as every rank has it, identity in forward; in backward each rank's partial input
    gradient is all-reduced (the local gradient is declared Partial, from_local's backward makes it Replicate)."""
    return DTensor.from_local(x, mesh, [Replicate()], run_check=False).to_local(grad_placements=[Partial()])


def reduce(y, mesh):
    """Megatron's g: the one all-reduce, partial sums -> the replicated sum; identity in backward."""
    return DTensor.from_local(y, mesh, [Partial()], run_check=False).redistribute(mesh, [Replicate()]).to_local()


def _shard(module, name, placements, mesh, shape=None):
    """Replace module.<name> by an nn.Parameter holding a DTensor with these placements (viewed as `shape`
    first, for c_attn's [d, 3, d])."""
    p = getattr(module, name)
    t = p.detach() if shape is None else p.detach().view(shape)
    module.register_parameter(name, torch.nn.Parameter(distribute_tensor(t, mesh, placements),
                                                       requires_grad=p.requires_grad))


def _unpack(module):
    """Drop packed copies (gpt2ffn.quantize): they were made from the whole matrices; a sharded layer runs its
    local fp32 shard. A weight held once (load_model's default fp32) gets its values back from them first."""
    for m in module.modules():
        if getattr(m, "packed", None) is not None:
            if m.held_at():  # a layer packed at bf16/int8/int4 alone: its only values are rounded
                raise Gpt2ffnError(f"tensor parallelism shards fp32 weights; a layer here is packed at {m.held_at()}")
            if m.dropped:
                m.restore_weight()
            m.packed, m.hold_once = None, False
    module.__dict__.pop("_plan", None)


class ShardedFeedForward(FeedForward):
    """A FeedForward whose c_fc holds hidden units hidden/N of this rank and c_proj the matching rows."""

    def forward(self, x):
        self.check_input(x)
        mesh = self.c_fc.weight.device_mesh
        x2 = enter(x.reshape(-1, x.shape[-1]), mesh)                                    # (N, d), replicated
        w1, b1, w2 = self.c_fc.weight.to_local(), self.c_fc.bias.to_local(), self.c_proj.weight.to_local()
        zero = torch.zeros((), dtype=x.dtype, device=x.device).expand(w2.shape[1])
        y = kernels.ffn(x2, w1, b1, w2, zero, self.config.gelu_approximate)             # (N, d/..) partial sum
        y = reduce(y, mesh) + self.c_proj.bias.to_local()                               # the one all-reduce
        y = y.view(*x.shape[:-1], y.shape[-1])
        return self.dropout(y) if self.training and self.dropout.p else y


class ShardedAttention(CausalSelfAttention):
    """Attention over this rank's heads: q, k, v of n_head/N heads, its rows of c_proj, one all-reduce."""

    def qkv(self, x):
        B, T, C = x.shape
        w, b = self.c_attn.weight.to_local(), self.c_attn.bias.to_local()              # (C, 3, C/N), (3, C/N)
        xl = enter(x.reshape(B * T, C), self.c_attn.weight.device_mesh)
        h = self.n_head // self.c_attn.weight.device_mesh.size()
        qkv = torch.addmm(b.reshape(-1), xl, w.reshape(C, -1)).view(B, T, 3, h, C // self.n_head)
        return [t.transpose(1, 2) for t in qkv.unbind(2)]                              # each (B, h, T, C/H)

    def project(self, y):
        B, T, _ = y.shape
        w = self.c_proj.weight
        out = reduce(y.reshape(B * T, -1) @ w.to_local(), w.device_mesh) + self.c_proj.bias.to_local()
        return self.resid_dropout(out.view(B, T, -1))


def shard_ffn(ffn: FeedForward, mesh: DeviceMesh) -> FeedForward:
    """Shard a FeedForward in place over the mesh; its forward and backward then run tensor-parallel."""
    check_world(ffn.config, mesh.size(), attention=False)
    _unpack(ffn)
    _shard(ffn.c_fc, "weight", [Shard(1)], mesh)      # [d, hidden]: columns = hidden units
    _shard(ffn.c_fc, "bias", [Shard(0)], mesh)
    _shard(ffn.c_proj, "weight", [Shard(0)], mesh)    # [hidden, d]: rows = the same hidden units
    _shard(ffn.c_proj, "bias", [Replicate()], mesh)
    ffn.__class__ = ShardedFeedForward
    return ffn


def shard_attention(attn: CausalSelfAttention, mesh: DeviceMesh) -> CausalSelfAttention:
    C = attn.n_embd
    _shard(attn.c_attn, "weight", [Shard(2)], mesh, (C, 3, C))     # q | k | v, each by head
    _shard(attn.c_attn, "bias", [Shard(1)], mesh, (3, C))
    _shard(attn.c_proj, "weight", [Shard(0)], mesh)                # rows = the heads' outputs
    _shard(attn.c_proj, "bias", [Replicate()], mesh)
    attn.__class__ = ShardedAttention
    return attn


def parallelize(model, mesh: DeviceMesh | None = None, vocab_parallel: bool = True):
    """Shard a GPT2 (or a FeedForward) in place over `mesh` (default: all ranks of the default process group).

    A world size that does not divide n_head or the hidden width raises Gpt2ffnError before any collective.
    vocab_parallel: the tied wte / lm_head split by vocabulary rows (else every rank keeps all of it).
    Packed weights (gpt2ffn.quantize) are dropped: the shards run in fp32 on torch's ops."""
    if not isinstance(model, (GPT2, FeedForward)):
        raise Gpt2ffnError(f"parallelize takes a GPT2 or a FeedForward, got {type(model).__name__}")
    world = mesh.size() if mesh is not None else (dist.get_world_size() if dist.is_initialized() else None)
    if world is None:
        raise Gpt2ffnError("tensor parallelism needs torch.distributed: launch with torchrun --nproc-per-node N "
                           "(or call torch.distributed.init_process_group first)")
    check_world(model.config, world, attention=isinstance(model, GPT2))
    if getattr(model, "precision", "fp32") not in ("fp32", None):
        raise Gpt2ffnError(f"tensor parallelism shards fp32 weights; this model is packed at {model.precision!r}")
    mesh = mesh or make_mesh(world)
    if isinstance(model, FeedForward):
        return shard_ffn(model, mesh)
    _unpack(model)
    for block in model.transformer.h:
        shard_attention(block.attn, mesh)
        shard_ffn(block.mlp, mesh)
    cfg = model.config
    # This rank's KV cache: n_head/N heads of the same width d/H.
    model.kv_config = dataclasses.replace(cfg, n_head=cfg.n_head // world, n_embd=cfg.n_embd // world)
    if vocab_parallel:
        # nn.Embedding and nn.Linear: the styles fit as they are. Rowwise on an embedding shards the vocabulary
        # (Shard(0)) and all-reduces the masked lookups; Colwise on lm_head shards the same rows and gathers the
        # logits. Both shard wte's tied Parameter alike; the second shard is then tied back to the first.
        parallelize_module(model, mesh, {"transformer.wte": RowwiseParallel(input_layouts=Replicate()),
                                         "lm_head": ColwiseParallel(output_layouts=Replicate())})
        model.lm_head.weight = model.transformer.wte.weight
        model.lm_head.register_forward_hook(_wait)
    model.mesh = mesh
    return model


def _wait(module, args, out):
    """ColwiseParallel's all-gather of the logits returns before it has finished (an AsyncCollectiveTensor): wait
    here, so a rank that never reads its logits (serving/tp.py's followers) leaves no collective in flight."""
    return out.wait() if isinstance(out, AsyncCollectiveTensor) else out


def local_bytes(module) -> int:
    """Bytes of the parameters this rank holds (a DTensor counts its local shard)."""
    seen, n = set(), 0
    for p in module.parameters():
        t = p.to_local() if isinstance(p, DTensor) else p
        if id(p) not in seen:
            seen.add(id(p))
            n += t.numel() * t.element_size()
    return n
