"""The process group of one tensor-parallel instance: ``size`` rank processes, formed from a TCP store.

Like the KV pair channels, each instance's group is built straight from the controller's store under its
own prefix (``tp/{instance}/{generation}``), so instances form and re-form independently, with no
global world. Two groups per instance:

* ``ctrl`` (gloo, effectively unbounded timeout): the driver's step descriptions. A follower waits here
  between steps for as long as the instance is idle; a dead driver makes the wait raise at once.
* ``data`` (gloo on CPU, NCCL on CUDA, ``collective_timeout_s``): the model's all-reduces. Every rank
  enters a step's collectives together, so a wait longer than the timeout means a rank hung or died.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed import PrefixStore, ProcessGroupGloo, TCPStore

from modeling.tp import CollectiveStats, TPShard

# gloo closes a pair whose operation outlives the group timeout: idle waits must be effectively unbounded.
_IDLE_TIMEOUT = datetime.timedelta(days=30)
_SUM_TAG = 11  # the data group's point-to-point tag for all-reduce exchanges
_BLOCKS_TAG = 12  # ... and for whole KV blocks moved between a rank and rank 0 (``send_to`` / ``recv_from``)


class TPError(RuntimeError):
    """A tensor-parallel group failed: a rank died, a collective timed out, or the protocol broke."""


@dataclass(frozen=True)
class TPGroupConfig:
    """``collective_timeout_s``: the longest a rank waits in one collective (a hung rank fails the
    instance after this long); ``connect_timeout_s``: how long forming the group waits for every rank."""

    collective_timeout_s: float = 60.0
    connect_timeout_s: float = 120.0
    interface_host: str = "127.0.0.1"

    def __post_init__(self) -> None:
        for name in ("collective_timeout_s", "connect_timeout_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"tensor_parallel.{name}: must be a number > 0, got {value!r}")


class TPGroup:
    """One rank's handle on its instance's groups."""

    def __init__(self, shard: TPShard, ctrl: ProcessGroupGloo, data: dist.ProcessGroup, device: torch.device,
                 store: dist.Store | None = None):
        self.shard = shard
        self.ctrl = ctrl
        self.data = data
        self.device = device  # where data collectives' tensors live
        self.store = store  # kept alive while the groups are
        self.collectives = CollectiveStats()  # the model's all-reduces (installed by tp_runner.load_for_rank)

    @property
    def rank(self) -> int:
        return self.shard.rank

    @property
    def size(self) -> int:
        return self.shard.size

    @staticmethod
    def form(store: TCPStore, instance_id: str, shard: TPShard, device: torch.device | str,
             config: TPGroupConfig = TPGroupConfig(), generation: int = 0) -> "TPGroup":
        """Join the group of ``instance_id`` (blocks until every rank has joined)."""
        device = torch.device(device)
        prefix = PrefixStore(f"tp/{instance_id}/{generation}", store)
        opts = ProcessGroupGloo._Options()
        opts._timeout = _IDLE_TIMEOUT
        opts._devices = [ProcessGroupGloo.create_device(hostname=config.interface_host)]
        try:
            ctrl = ProcessGroupGloo(PrefixStore("ctrl", prefix), shard.rank, shard.size, opts)
            timeout = datetime.timedelta(seconds=config.collective_timeout_s)
            if device.type == "cuda":
                nccl_opts = dist.ProcessGroupNCCL.Options()
                nccl_opts._timeout = timeout
                torch.cuda.set_device(device)
                data: dist.ProcessGroup = dist.ProcessGroupNCCL(PrefixStore("nccl", prefix), shard.rank, shard.size,
                                                                nccl_opts)
            else:
                data_opts = ProcessGroupGloo._Options()
                data_opts._timeout = timeout
                data_opts._devices = opts._devices
                data = ProcessGroupGloo(PrefixStore("data", prefix), shard.rank, shard.size, data_opts)
        except RuntimeError as err:
            raise TPError(f"{instance_id}: forming the tensor-parallel group failed at rank {shard.rank}: {err}") from err
        return TPGroup(shard, ctrl, data, device, store)

    # -- collectives ------------------------------------------------------------------------------

    def all_reduce(self, tensor: torch.Tensor) -> None:
        """Sum ``tensor`` over the ranks, in place (the model's row-parallel outputs). Every rank ends with
        bit-identical values.

        On gloo with a power-of-two group this is recursive doubling over send/recv (log2(size) pairwise
        exchanges): gloo's own allreduce takes several round trips per call, about 6x the latency of one
        exchange for the small activations of a decode step. Each exchange adds the partner's partial sum
        to one's own, and float addition is commutative, so both partners hold the same bits."""
        try:
            if self.device.type == "cpu" and self.size & (self.size - 1) == 0:
                self._exchange_sum(tensor)
            else:
                self.data.allreduce([tensor]).wait()
        except RuntimeError as err:
            raise TPError(f"all-reduce failed at rank {self.rank}: {err}") from err

    def _exchange_sum(self, tensor: torch.Tensor) -> None:
        flat = tensor if tensor.is_contiguous() else tensor.contiguous()
        other = torch.empty_like(flat)
        step = 1
        while step < self.size:
            partner = self.rank ^ step
            sent = self.data.send([flat], partner, _SUM_TAG)
            self.data.recv([other], partner, _SUM_TAG).wait()
            sent.wait()
            flat.add_(other)
            step *= 2
        if flat is not tensor:
            tensor.copy_(flat)

    def send_to(self, tensor: torch.Tensor, rank: int) -> None:
        """Send a contiguous tensor (on ``device``) to ``rank`` over the data group; returns once it is taken."""
        try:
            self.data.send([tensor], rank, _BLOCKS_TAG).wait()
        except RuntimeError as err:
            raise TPError(f"send from rank {self.rank} to rank {rank} failed: {err}") from err

    def recv_from(self, tensor: torch.Tensor, rank: int) -> None:
        """Receive into a contiguous tensor (on ``device``) what ``rank`` sends with :meth:`send_to`."""
        try:
            self.data.recv([tensor], rank, _BLOCKS_TAG).wait()
        except RuntimeError as err:
            raise TPError(f"receive at rank {self.rank} from rank {rank} failed: {err}") from err

    def broadcast_ctrl(self, tensor: torch.Tensor) -> None:
        """Rank 0's ``tensor`` to every rank, over the control group (CPU tensors)."""
        try:
            self.ctrl.broadcast(tensor, 0).wait()
        except RuntimeError as err:
            raise TPError(f"control broadcast failed at rank {self.rank}: {err}") from err

    def all_gather_ctrl(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's equally-shaped ``tensor``, in rank order, over the control group."""
        out = [torch.empty_like(tensor) for _ in range(self.size)]
        try:
            self.ctrl.allgather([out], [tensor]).wait()
        except RuntimeError as err:
            raise TPError(f"control all-gather failed at rank {self.rank}: {err}") from err
        return out

    def barrier(self) -> None:
        """Return once every rank has called it (over the control group)."""
        self.all_gather_ctrl(torch.zeros(1, dtype=torch.int64))
