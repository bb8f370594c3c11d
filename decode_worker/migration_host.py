"""The decode worker's side of the ``MigrationHost`` interface (``decode_worker/live_migration.py``): the few
operations live migration may do on the instance, over the worker's parts."""

from __future__ import annotations

from decode_worker.admission import Admission
from decode_worker.drafters import DraftModelDrafter
from decode_worker.held import HeldRequest
from decode_worker.live_migration import DraftState
from decode_worker.messages import DecodeRequest
from decode_worker.migration_sender import MigrationLegs
from decode_worker.ranks import FollowerRanks
from decode_worker.sources import MigrationIn
from decode_worker.speculation import Speculator
from kv_transfer.channel import TransferConfig
from modeling.checkpoint import LoadedModel
from modeling.errors import InvalidRequestError, OutOfBlocksError
from modeling.kv_cache import PagedKVCache
from modeling.sequence import Sequence, SequenceStatus


class WorkerMigrationHost:
    """``MigrationHost`` of a decode worker (rank 0 of its instance)."""

    def __init__(self, instance_id: str, loaded: LoadedModel, cache: PagedKVCache, transfer: TransferConfig | None,
                 ranks: FollowerRanks | None, admission: Admission, speculator: Speculator, events: list):
        """``events``: the worker's list of output raised between steps (appended to, never replaced)."""
        self.instance_id = instance_id
        self.block_size = admission.scheduler.pool.block_size
        self.max_model_len = admission.max_model_len
        self.ranks = ranks
        self._loaded, self._cache, self._transfer = loaded, cache, transfer
        self._admission = admission
        self._requests = admission.requests
        self._scheduler = admission.scheduler
        self._speculator = speculator
        self._events = events

    def open_legs(self) -> MigrationLegs:
        if self._transfer is None:
            raise InvalidRequestError("destination", "this worker moves no KV (it was built without transfer)")
        size = 1 if self.ranks is None else self.ranks.size
        return MigrationLegs(self._cache, self.instance_id, 0, size, self._loaded.config, self.block_size,
                             self._loaded.kv_heads, self._transfer)

    def max_k(self) -> int:
        return self._speculator.spec.max_k

    def step_tokens(self) -> int:
        return self._speculator.step_tokens()

    def admit(self, request: DecodeRequest, source: MigrationIn) -> bool:
        return self._admission.admit(request, source)

    def held(self, request_id: str) -> HeldRequest | None:
        return self._requests.get(request_id)

    def stop(self, seq: Sequence) -> None:
        self._scheduler.running.pop(seq.request_id)
        self._speculator.forget_choice()

    def join(self, seq: Sequence, draft: DraftState | None) -> None:
        seq.block_table.truncate(self._scheduler.pool, seq.num_tokens)
        self._scheduler.start(seq)
        drafter = self._speculator.drafter
        try:
            if draft is None or not isinstance(drafter, DraftModelDrafter):
                raise ValueError("no draft cache to import")
            drafter.import_state(seq, *draft)
        except (ValueError, OutOfBlocksError):  # none sent, another draft model, or no room: rebuild it here
            drafter.admit(seq)

    def resume(self, seq: Sequence) -> None:
        self._scheduler.start(seq)
        drafter = self._speculator.drafter
        if isinstance(drafter, DraftModelDrafter) and not drafter.holds(seq):
            drafter.admit(seq)  # the drafter was rebuilt meanwhile (set_speculation)
        self._speculator.forget_choice()

    def release(self, request_id: str) -> None:
        held = self._requests.pop(request_id)
        self._speculator.drafter.release(held.seq)
        self._scheduler.prefix_cache.forget(request_id)
        held.seq.block_table.release(self._scheduler.pool)  # its cached blocks stay cached here
        held.seq.status = SequenceStatus.FINISHED

    def export_draft(self, seq: Sequence) -> DraftState | None:
        drafter = self._speculator.drafter
        if isinstance(drafter, DraftModelDrafter) and drafter.holds(seq):
            return drafter.export_state(seq)
        return None

    def emit(self, event: object) -> None:
        self._events.append(event)
