"""Bringing up the cluster: Ray, one placement group per pool, worker actors, KV channels.

Prefill and decode instances land on separate resource sets: each pool gets its own placement group
(one bundle per instance, ``{"CPU": cpus_per_instance, "GPU": devices_per_instance}``), so the two
pools never share a GPU. The controller process hosts the TCP store that every (prefill, decode) pair
uses to form its KV channel. In ``mode: colocated`` there is one pool, ``colocated`` (placed the same
way), of reference-engine instances, and no KV channels.
"""

from __future__ import annotations

import asyncio
import logging
import os

from controller.actors import ColocatedActor, DecodeActor, PrefillActor, ray_actor_class
from controller.config import ClusterConfig
from controller.router import Instance
from decode_worker.config import DecodeWorkerConfig
from kv_transfer.channel import Rendezvous, TransferConfig
from modeling.engine import EngineConfig
from prefill_worker.config import PrefillWorkerConfig

log = logging.getLogger("magicserve.cluster")

PLACEMENT_TIMEOUT_S = 120.0


class ClusterError(RuntimeError):
    pass


def _pool_settings(cfg: ClusterConfig, pool) -> dict:
    """The worker settings every pool section gives the same way."""
    return dict(dtype=cfg.model.dtype, device="cuda" if pool.devices_per_instance else "cpu",
                block_size=pool.block_size, kv_cache_tokens=pool.kv_cache_tokens,
                attention_backend=pool.attention_backend)


def prefill_worker_config(cfg: ClusterConfig) -> PrefillWorkerConfig:
    p = cfg.prefill
    return PrefillWorkerConfig(**_pool_settings(cfg, p), token_budget=p.chunk_tokens, max_num_seqs=p.max_batch_prompts,
                               transfer=transfer_config(cfg))


def decode_worker_config(cfg: ClusterConfig) -> DecodeWorkerConfig:
    d = cfg.decode
    return DecodeWorkerConfig(**_pool_settings(cfg, d), max_num_seqs=d.max_num_seqs, speculation=d.speculation)


def colocated_engine_config(cfg: ClusterConfig) -> EngineConfig:
    c = cfg.colocated
    return EngineConfig(**_pool_settings(cfg, c), token_budget=c.chunk_tokens, max_num_seqs=c.max_num_seqs)


def transfer_config(cfg: ClusterConfig) -> TransferConfig:
    return TransferConfig(timeout_s=cfg.kv_transfer.timeout_s, interface_host=cfg.kv_transfer.rendezvous_host)


class Cluster:
    """Owns the Ray connection, placement groups, actors and the KV rendezvous store."""

    def __init__(self, config: ClusterConfig):
        disaggregated = config.mode == "disaggregated"
        if disaggregated and config.prefill.block_size != config.decode.block_size:
            raise ClusterError("decode.block_size: must equal prefill.block_size (KV moves block by block)")
        if any(p.tensor_parallel > 1 for p in config.pools.values()):
            raise ClusterError("tensor_parallel: sharded model execution is not available yet; use 1 "
                               "(KV transfer already reshards heads between TP degrees)")
        self.config = config
        self.prefill: list[Instance] = []
        self.decode: list[Instance] = []
        self.colocated: list[Instance] = []
        self._groups = []
        self._store = None
        self.rendezvous: Rendezvous | None = None
        self._started_ray = False

    # -- bring-up ---------------------------------------------------------------------------------

    def start(self) -> None:
        import ray

        self._init_ray(ray)
        model = self.config.model_path
        if not os.path.isdir(model):
            raise ClusterError(f"model.path: {model} is not a directory")
        if self.config.mode == "colocated":
            self._start_colocated(model)
        else:
            self._start_disaggregated(model)
        log.info("cluster up: %s", self.config.describe_pools())

    @property
    def instances(self) -> list[Instance]:
        return self.prefill + self.decode + self.colocated

    def _start_disaggregated(self, model: str) -> None:
        import ray

        self._store, self.rendezvous = Rendezvous.host_store(self.config.kv_transfer.rendezvous_host)
        pcfg, dcfg = prefill_worker_config(self.config), decode_worker_config(self.config)
        p, d = self.config.prefill, self.config.decode
        self.prefill = self._start_pool("prefill", p, PrefillActor, lambda name: (model, pcfg, name, p.threads))
        self.decode = self._start_pool("decode", d, DecodeActor,
                                       lambda name: (model, dcfg, name, d.threads, transfer_config(self.config)))
        ray.get([i.handle.ping.remote() for i in self.instances])
        self._connect_all()

    def _start_colocated(self, model: str) -> None:
        import ray

        ecfg = colocated_engine_config(self.config)
        self.colocated = self._start_pool("colocated", self.config.colocated, ColocatedActor,
                                          lambda name: (model, ecfg, name, self.config.colocated.threads))
        ray.get([i.handle.ping.remote() for i in self.instances])

    def _init_ray(self, ray) -> None:
        rc = self.config.ray
        if ray.is_initialized():
            return
        if rc.address:
            ray.init(address=rc.address, namespace=rc.namespace, log_to_driver=True)
        else:
            pools = self.config.pools.values()
            need_cpus = sum(p.instances * p.cpus_per_instance for p in pools)
            need_gpus = sum(p.instances * p.devices_per_instance for p in pools)
            ray.init(num_cpus=rc.num_cpus if rc.num_cpus is not None else max(need_cpus, os.cpu_count() or 1),
                     num_gpus=rc.num_gpus if rc.num_gpus is not None else need_gpus,
                     namespace=rc.namespace, include_dashboard=False, log_to_driver=True)
            self._started_ray = True

    def _start_pool(self, role: str, pool, actor_cls, args) -> list[Instance]:
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        bundle = {"CPU": pool.cpus_per_instance}
        if pool.devices_per_instance:
            bundle["GPU"] = pool.devices_per_instance
        group = placement_group([dict(bundle) for _ in range(pool.instances)], strategy="PACK", name=f"magicserve-{role}")
        ready, _ = ray.wait([group.ready()], timeout=PLACEMENT_TIMEOUT_S)
        if not ready:
            ray.util.remove_placement_group(group)
            raise ClusterError(f"{role}: cannot place {pool.instances} instances of {bundle} "
                               f"(cluster resources: {ray.cluster_resources()})")
        self._groups.append(group)
        remote_cls = ray_actor_class(actor_cls)
        instances = []
        for i in range(pool.instances):
            name = f"{role}-{i}"
            handle = remote_cls.options(
                name=f"magicserve-{name}", num_cpus=pool.cpus_per_instance, num_gpus=pool.devices_per_instance,
                scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=i),
            ).remote(*args(name))
            instances.append(Instance(name, role, handle))
        return instances

    # -- KV channels ------------------------------------------------------------------------------

    def _pair_calls(self, prefill: Instance, decode: Instance):
        gen = prefill.generation + decode.generation
        host, port = self.rendezvous.host, self.rendezvous.port
        return [prefill.handle.connect.remote(decode.name, host, port, gen),
                decode.handle.connect.remote(prefill.name, host, port, gen)]

    def _connect_all(self) -> None:
        import ray

        refs = [r for p in self.prefill for d in self.decode for r in self._pair_calls(p, d)]
        ray.get(refs, timeout=self.config.kv_transfer.timeout_s * 4 + 60)

    async def rewire(self, inst: Instance) -> None:
        """Re-form every KV channel of an instance that Ray restarted."""
        peers = self.decode if inst.role == "prefill" else self.prefill
        refs = []
        for peer in peers:
            if peer.alive:
                p, d = (inst, peer) if inst.role == "prefill" else (peer, inst)
                refs.extend(self._pair_calls(p, d))
        await asyncio.gather(*refs)

    # -- status and shutdown ----------------------------------------------------------------------

    async def statuses(self) -> list[dict]:
        out = []
        for inst in self.instances:
            try:
                st = await asyncio.wait_for(inst.handle.status.remote(), 5.0) if inst.alive else None
            except Exception:
                st = None
            if st is None:
                st = {"name": inst.name, "role": inst.role, "device": "", "queue_length": 0, "running": 0,
                      "free_kv_blocks": 0, "total_kv_blocks": 0}
            st["alive"] = inst.alive and st.get("device", "") != ""
            out.append(st)
        return out

    async def drain_pass_logs(self) -> list[dict]:
        """Every live instance's timed passes since the last drain (``modeling/pass_log.py``): per instance
        ``name``, ``role``, ``records`` and ``dropped`` (passes its log could not keep)."""
        live = [inst for inst in self.instances if inst.alive]
        logs = await asyncio.gather(*(asyncio.wait_for(inst.handle.pass_log_counted.remote(), 30.0) for inst in live))
        return [{"name": inst.name, "role": inst.role, **log} for inst, log in zip(live, logs)]

    def shutdown(self) -> None:
        import ray

        for inst in self.instances:
            try:
                ray.kill(inst.handle, no_restart=True)
            except Exception:
                pass
        for g in self._groups:
            try:
                ray.util.remove_placement_group(g)
            except Exception:
                pass
        if self._started_ray:
            ray.shutdown()
